"""The traffic-log record: one per decision, names and verdicts only, never values or bodies."""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field


class TrafficRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    time: float = Field(default_factory=time.time)
    kind: str = "http"  # http | connect | tunnel | websocket | connection
    cvm_id: str | None = None
    owner: str | None = None
    team: str | None = None
    policy_hash: str | None = None
    method: str | None = None
    connect_host: str | None = None
    sni: str | None = None
    host_header: str | None = None
    port: int | None = None
    pinned_ip: str | None = None
    path: str | None = None
    query_keys: list[str] = Field(default_factory=list)
    decision: str = "deny"
    rule_id: str | None = None
    reason: str = ""
    status: int | None = None
    request_bytes: int = 0
    response_bytes: int = 0
    duration_ms: float = 0.0
    scan_rule_ids: list[str] = Field(default_factory=list)
    injected_headers: list[str] = Field(default_factory=list)
    detail: str = ""


class Redactor:
    """Removes secret values (in any scanned encoding) from a record before it is written.

    Names are logged by design (hosts, paths, query keys), and a sandbox can put a secret in a
    name; the record must still never carry it.
    """

    def __init__(self, secrets: list[tuple[str, str]]) -> None:
        from umbra.proxy.scanner import MIN_SECRET_LENGTH, secret_encodings

        self._forms = sorted(
            {
                form.decode("utf-8", "replace")
                for _ref, value in secrets
                if len(value) >= MIN_SECRET_LENGTH
                for form in secret_encodings(value.encode())
            },
            key=len,
            reverse=True,
        )

    def redact(self, record: TrafficRecord) -> TrafficRecord:
        if not self._forms:
            return record
        text = record.model_dump_json()
        if not any(form in text for form in self._forms):
            return record
        data = record.model_dump()
        for key, value in data.items():
            if isinstance(value, str):
                data[key] = self._clean(value)
            elif isinstance(value, list):
                data[key] = [self._clean(item) if isinstance(item, str) else item for item in value]
        return TrafficRecord.model_validate(data)

    def _clean(self, value: str) -> str:
        for form in self._forms:
            if form in value:
                value = value.replace(form, "[redacted]")
        return value
