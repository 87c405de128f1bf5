"""One event per traffic record or audit entry, with OCSF-shaped field names where they fit
(HTTP Activity 4002 for traffic, API Activity 6003 for the audit log); the field table is in
docs/specs/console.md "SIEM export". Never values or bodies: a record has none, and an audit
entry's details never hold secret values (they are written by the Console's own services)."""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from umbra.console.models import AuditEntry, TrafficRecord

PRODUCT = "Umbra"
SERVICE = "umbra-console"
# RFC 5424 SD-ID: the IANA example enterprise number until Umbra registers its own.
SD_ID = "umbra@32473"


class Stream(StrEnum):
    TRAFFIC = "traffic"
    AUDIT = "audit"


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _drop_empty(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if v is not None and v != [] and v != ""}


def traffic_event(row: TrafficRecord) -> dict[str, Any]:
    denied = row.decision == "deny"
    return _drop_empty(
        {
            "time": _utc(row.time).isoformat(),
            "class_uid": 4002,  # OCSF HTTP Activity
            "category_uid": 4,  # Network Activity
            "severity_id": 3 if denied else 1,  # Medium / Informational
            "metadata.uid": row.id,
            "metadata.product.name": PRODUCT,
            "metadata.log_name": Stream.TRAFFIC.value,
            "metadata.tenant_uid": row.team,
            "disposition": "Blocked" if denied else "Allowed",
            "disposition_id": 2 if denied else 1,
            "status_detail": row.reason,
            "firewall_rule.uid": row.rule_id,
            "policy.uid": row.policy_hash,
            "actor.user.uid": row.owner,
            "device.uid": row.cvm_id,
            "http_request.http_method": row.method,
            "http_request.url.hostname": row.host,
            "http_request.url.path": row.path,
            "http_request.url.port": row.port,
            "http_response.code": row.status,
            "dst_endpoint.hostname": row.connect_host,
            "dst_endpoint.ip": row.pinned_ip,
            "tls.sni": row.sni,
            "traffic.bytes_out": row.bytes_sent,
            "traffic.bytes_in": row.bytes_received,
            "duration": row.duration_ms,
            "umbra.kind": row.kind,
            "umbra.security_cvm_id": row.security_cvm_id,
            "umbra.query_keys": list(row.query_keys),  # names only; the proxy never keeps values
            "umbra.scan_rule_ids": list(row.scan_rule_ids),
            "umbra.injected_headers": list(row.injected_headers),  # header names only
            "umbra.detail": row.detail,
            "umbra.truncated": list(row.truncated),
            "umbra.llm.model": row.llm_model,
            "umbra.llm.input_tokens": row.llm_input_tokens,
            "umbra.llm.output_tokens": row.llm_output_tokens,
        }
    )


def audit_event(entry: AuditEntry) -> dict[str, Any]:
    return _drop_empty(
        {
            "time": _utc(entry.time).isoformat(),
            "class_uid": 6003,  # OCSF API Activity
            "category_uid": 6,  # Application Activity
            "severity_id": 1,
            "metadata.uid": str(entry.seq),
            "metadata.product.name": PRODUCT,
            "metadata.log_name": Stream.AUDIT.value,
            "metadata.tenant_uid": entry.team,
            "actor.user.uid": entry.actor,
            "api.operation": str(entry.action),
            "resources.uid": entry.target,
            "unmapped.details": json.dumps(entry.details, sort_keys=True, separators=(",", ":")),
            "umbra.audit.seq": entry.seq,
            "umbra.audit.hash": entry.hash,
            "umbra.audit.prev_hash": entry.prev_hash,
        }
    )


def event_json(event: dict[str, Any]) -> str:
    """ASCII-only JSON (no raw newline, control character or lone surrogate reaches a receiver)."""
    return json.dumps(event, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


# --- OTLP/HTTP JSON (opentelemetry-proto's ExportLogsServiceRequest) -----------------------------


def _any_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}  # int64 is a string in proto3 JSON
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list):
        return {"arrayValue": {"values": [_any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def otlp_log_record(event: dict[str, Any], observed_ns: int) -> dict[str, Any]:
    time_ns = int(datetime.fromisoformat(event["time"]).timestamp() * 1_000_000) * 1000
    warn = event.get("disposition_id") == 2
    return {
        "timeUnixNano": str(time_ns),
        "observedTimeUnixNano": str(observed_ns),
        "severityNumber": 13 if warn else 9,  # WARN / INFO
        "severityText": "WARN" if warn else "INFO",
        "eventName": f"umbra.{event['metadata.log_name']}",
        "body": {"stringValue": event_json(event)},
        "attributes": [
            {"key": key, "value": _any_value(value)}
            for key, value in sorted(event.items())
            if key != "time"
        ],
    }


def otlp_request(events: list[dict[str, Any]], observed_ns: int) -> dict[str, Any]:
    return {
        "resourceLogs": [
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": SERVICE}}]
                },
                "scopeLogs": [
                    {
                        "scope": {"name": "umbra.console.export"},
                        "logRecords": [otlp_log_record(e, observed_ns) for e in events],
                    }
                ],
            }
        ]
    }


# --- RFC 5424 over TLS with RFC 5425 octet counting ----------------------------------------------

_FACILITY = {Stream.TRAFFIC: 16, Stream.AUDIT: 13}  # local0 / log audit


def _sd_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("]", "\\]")


def syslog_message(event: dict[str, Any], hostname: str | None = None) -> bytes:
    stream = Stream(event["metadata.log_name"])
    severity = 4 if event.get("disposition_id") == 2 else 6  # warning / informational
    pri = _FACILITY[stream] * 8 + severity
    host = (hostname or socket.gethostname() or "-")[:255]
    stamp = datetime.fromisoformat(event["time"]).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    sd = (
        f'[{SD_ID} uid="{_sd_value(str(event["metadata.uid"]))}" '
        f'team="{_sd_value(str(event.get("metadata.tenant_uid", "")))}"]'
    )
    line = f"<{pri}>1 {stamp} {host} {SERVICE} - {stream.value} {sd} {event_json(event)}"
    return line.encode("ascii")


def octet_counted(message: bytes) -> bytes:
    return b"%d %s" % (len(message), message)
