"""The traffic-log addon: the one place the proxy constructs traffic-log records.

Other addons report decisions through `flow_record`, `connection_record` and `websocket_record`;
the hooks here log what finished (`response`, `error`). Every record is redacted before it is
written: values of every secret the proxy holds *now* (the set changes as the Console releases
secrets), every match of the policy's scan rules, and names (path, query keys) of a flow whose
request the scanner flagged.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from mitmproxy import connection, http

from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import ConnTable, FlowState, Stage, flow_state
from umbra.proxy.secrets import SecretStore
from umbra.proxy.spool import Spool
from umbra.proxy.state import PolicyState
from umbra.proxy.trafficlog import Redactor, TrafficRecord

logger = logging.getLogger(__name__)

REDACTED = "[redacted]"


class TrafficLog:
    def __init__(self, state: PolicyState, conns: ConnTable, spool: Spool | None) -> None:
        self._state = state
        self._conns = conns
        self._spool = spool
        self._secrets: SecretStore | None = None
        self._redactor = Redactor([])
        self._patterns: dict[str, list[re.Pattern[str]]] = {}
        self.records = 0

    # ---------------------------------------------------------------- redaction

    def _current_redactor(self) -> Redactor:
        secrets = self._state.secrets
        if secrets is not self._secrets:
            # Secrets released after start-up must be redacted too: rebuild on every swap.
            self._redactor = Redactor([(item.ref, item.value) for item in secrets.all_values()])
            self._secrets = secrets
        return self._redactor

    def _rule_patterns(self, fstate: FlowState | None) -> list[re.Pattern[str]]:
        if fstate is None or fstate.effective is None:
            return []
        policy = fstate.effective.policy
        patterns = self._patterns.get(policy.hash)
        if patterns is None:
            patterns = []
            for rule in policy.scan_rules:
                try:
                    patterns.append(re.compile(rule.regex.replace(r"\b", "")))
                except re.error:
                    continue
            if len(self._patterns) > 64:
                self._patterns.clear()
            self._patterns[policy.hash] = patterns
        return patterns

    def _redact(self, record: TrafficRecord, fstate: FlowState | None) -> TrafficRecord:
        if fstate is not None and (fstate.scan_rule_ids or fstate.detected):
            # The scanner saw a secret somewhere in this request, perhaps encoded: names that came
            # from the request are not worth the risk.
            record.path = REDACTED if record.path else record.path
            record.query_keys = [REDACTED] if record.query_keys else []
        patterns = self._rule_patterns(fstate) if record.decision != "allow" else []
        if patterns:
            data = record.model_dump()
            for key, value in data.items():
                if isinstance(value, str) and key not in ("id", "decision", "reason", "kind"):
                    for pattern in patterns:
                        value = pattern.sub(REDACTED, value)
                    data[key] = value
                elif isinstance(value, list):
                    cleaned = []
                    for item in value:
                        if isinstance(item, str):
                            for pattern in patterns:
                                item = pattern.sub(REDACTED, item)
                        cleaned.append(item)
                    data[key] = cleaned
            record = TrafficRecord.model_validate(data)
        return self._current_redactor().redact(record)

    def emit(self, record: TrafficRecord, fstate: FlowState | None = None) -> None:
        self.records += 1
        if record.decision != "allow" and record.reason in (
            Reason.INTERNAL_ERROR,
            Reason.POLICY_UNAVAILABLE,
        ):
            logger.error("denied (%s): %s", record.reason, record.detail[:200])
        if self._spool is not None:
            self._spool.append(self._redact(record, fstate))

    # ---------------------------------------------------------------- construction

    def base(self, client: connection.Client) -> TrafficRecord:
        state = self._conns.get(client)
        identity = state.identity
        return TrafficRecord(
            cvm_id=identity.cvm_id if identity else None,
            owner=identity.owner if identity else None,
            team=identity.team if identity else None,
            connect_host=state.connect_raw,
            sni=client.sni,
            port=state.connect_port,
        )

    def flow_record(
        self,
        flow: http.HTTPFlow,
        decision: str,
        reason: Reason,
        detail: str = "",
        **extra: Any,
    ) -> None:
        fstate = flow_state(flow)
        if fstate.logged:
            return
        fstate.logged = True
        record = self.base(flow.client_conn)
        conn = self._conns.get(flow.client_conn)
        record.method = flow.request.method[:16]
        record.host_header = (flow.request.host_header or "")[:260] or None
        if conn.connect_raw is None:
            record.connect_host = flow.request.host[:260]
            record.port = flow.request.port
        record.policy_hash = fstate.effective.policy.hash if fstate.effective else None
        if fstate.decision is not None:
            record.path = fstate.decision.path
            record.rule_id = fstate.decision.rule_id
        record.query_keys = fstate.query_keys
        record.decision = decision
        record.reason = str(reason)
        record.detail = detail[:300]
        record.status = reason.status
        record.scan_rule_ids = sorted(fstate.scan_rule_ids)
        record.injected_headers = fstate.injected_headers
        record.request_bytes = len(flow.request.raw_content or b"")
        record.duration_ms = round((time.monotonic() - fstate.started) * 1000, 3)
        if flow.server_conn.peername:
            record.pinned_ip = str(flow.server_conn.peername[0])
        for key, value in extra.items():
            setattr(record, key, value)
        self.emit(record, fstate)

    def connection_record(
        self,
        client: connection.Client,
        host: str,
        port: int,
        reason: str,
        detail: str,
        pinned: str | None = None,
    ) -> None:
        record = self.base(client)
        record.kind = "connection"
        record.connect_host = record.connect_host or host
        record.port = port
        record.reason = reason
        record.detail = detail[:300]
        record.status = 502
        record.pinned_ip = pinned
        self.emit(record)

    def websocket_record(
        self, flow: http.HTTPFlow, reason: Reason, rule_ids: list[str], detail: str = ""
    ) -> None:
        fstate = flow_state(flow)
        record = self.base(flow.client_conn)
        record.kind = "websocket"
        record.method = "WS"
        record.decision = "deny"
        record.reason = str(reason)
        record.detail = detail[:300]
        record.scan_rule_ids = rule_ids
        record.policy_hash = fstate.effective.policy.hash if fstate.effective else None
        record.host_header = flow.request.host_header
        self.emit(record, fstate)

    # ---------------------------------------------------------------- hooks

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT" or flow.response is None:
            return
        fstate = flow_state(flow)
        if fstate.stage is not Stage.ALLOWED or fstate.logged:
            return
        size = fstate.response_bytes or len(flow.response.raw_content or b"")
        self.flow_record(
            flow,
            "allow",
            Reason.RULE_ALLOW,
            status=flow.response.status_code,
            response_bytes=size,
        )

    def error(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        if fstate.logged:
            return
        message = flow.error.msg if flow.error else "error"
        reason = error_reason(message, flow)
        allowed = fstate.stage is Stage.ALLOWED and reason is not Reason.UPSTREAM_REFUSED
        self.flow_record(flow, "error" if allowed else "deny", reason, message[:200])


def error_reason(message: str, flow: http.HTTPFlow) -> Reason:
    """Classify mitmproxy's flow error: which side broke the exchange."""
    lowered = message.lower()
    if "body_size_limit" in message:
        return Reason.BODY_TOO_LARGE
    if message.startswith("Connection killed"):
        return Reason.UPSTREAM_REFUSED  # server_connect refused the dial (logged with why)
    if "killed" in lowered:
        return Reason.KILLED
    if "client" in lowered or (
        "received" in lowered
        and flow.response is None
        and (flow.server_conn.timestamp_start is None)
    ):
        # The sandbox's own framing (bad chunking, disconnects mid-request) is not the upstream's.
        return Reason.CLIENT_ERROR if "client" in lowered else Reason.INVALID_REQUEST
    if "smuggling" in lowered:
        return Reason.INVALID_REQUEST
    return Reason.UPSTREAM_ERROR
