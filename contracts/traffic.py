"""The traffic-log record: the one schema the proxy writes, spools and ships, and the Console stores.

Sandbox code controls several fields (Host header, CONNECT target, path, method, query keys), so
the limits here are what the proxy can actually produce, and the proxy builds records with
`TrafficRecord.build`, which never fails: a value over a limit is cut, a control character is
replaced, a lone surrogate is written as its `\\uXXXX` escape, and the field's name is listed in
`truncated` so readers know the value is not verbatim.
The Console validates each record of a batch on its own with the same model; one it still cannot
accept (an old or foreign shipper) is quarantined with the reason, never blocking the batch.

Names and verdicts only, never values or bodies.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    AliasChoices,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
)

from umbra.contracts.validation import location

MAX_HOST = 260  # a 253-octet name, ':' and a port, or a bracketed IPv6 literal with a port
MAX_PATH = 8192
MAX_METHOD = 32
MAX_QUERY_KEY = 256
MAX_QUERY_KEYS = 256
MAX_DETAIL = 1024
MAX_OWNER = 255
MAX_RULE = 160
MAX_RULE_IDS = 256
MAX_HEADERS = 64
MAX_BIGINT = (1 << 63) - 1
MAX_BATCH_RECORDS = 10_000
MAX_MODEL = 128
# More tokens than any one response could carry: a usage field above it is not believed.
MAX_TOKENS = 100_000_000

_PRINTABLE = r"^[^\x00-\x1f\x7f]*$"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# A lone surrogate (mitmproxy decodes raw non-UTF-8 bytes with surrogateescape) cannot be encoded
# as UTF-8, so it could be neither validated nor spooled: it is written as its `\uXXXX` escape.
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_METHOD_SYNTAX = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"  # RFC 9110 token: what a raw method may be
_TOKEN_CHARS = re.compile(r"[^!#$%&'*+.^_`|~0-9A-Za-z-]")
_RULE = r"^[A-Za-z0-9._:/-]{1,160}$"
_RULE_CHARS = re.compile(r"[^A-Za-z0-9._:/-]")
_REASON = r"^[a-z0-9_]{0,64}$"
_CVM_ID = r"^[A-Za-z0-9_.:-]{1,40}$"  # the Console checks it names a Dev CVM of the team
_TEAM = r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$"
_HEADER_NAME = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$"


class Kind(StrEnum):
    HTTP = "http"
    CONNECT = "connect"
    TUNNEL = "tunnel"
    WEBSOCKET = "websocket"
    CONNECTION = "connection"


class Decision(StrEnum):
    ALLOW = "allow"
    DENY = "deny"


def _utc(value: datetime) -> datetime:
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("time is out of range once converted to UTC") from None


def _escape_surrogates(value: str) -> str:
    return _SURROGATE.sub(lambda match: f"\\u{ord(match[0]):04x}", value)


def _printable(limit: int) -> Any:
    return Field(max_length=limit, pattern=_PRINTABLE)


Text = Annotated[str, _printable(MAX_HOST)]
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS, strict=True)]


class TrafficRecord(BaseModel):
    """One proxy decision. Construct with `build` on the proxy; validate as is on the Console."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, description="Idempotency key (per team).")
    time: Annotated[AwareDatetime, AfterValidator(_utc)] = Field(
        default_factory=lambda: datetime.now(UTC),
        description="RFC 3339 with offset, or Unix seconds.",
    )
    kind: Kind = Kind.HTTP
    cvm_id: Annotated[str, Field(pattern=_CVM_ID)] | None = None
    owner: Annotated[str, Field(min_length=1), _printable(MAX_OWNER)] | None = None
    team: Annotated[str, Field(pattern=_TEAM)] | None = Field(
        default=None, description="Omitted: the Security CVM's team."
    )
    policy_hash: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")] | None = None
    method: Annotated[str, Field(max_length=MAX_METHOD, pattern=_METHOD_SYNTAX)] | None = None
    connect_host: Text | None = None
    sni: Text | None = None
    host: Text | None = Field(default=None, validation_alias=AliasChoices("host", "host_header"))
    port: Annotated[int, Field(ge=0, le=65535)] | None = None
    pinned_ip: Annotated[str, Field(max_length=64, pattern=r"^[0-9A-Fa-f:.]+$")] | None = None
    path: Annotated[str, _printable(MAX_PATH)] | None = None
    query_keys: list[Annotated[str, _printable(MAX_QUERY_KEY)]] = Field(
        default_factory=list, max_length=MAX_QUERY_KEYS
    )
    decision: Decision
    rule_id: Annotated[str, Field(pattern=_RULE)] | None = None
    reason: Annotated[str, Field(pattern=_REASON)] | None = None
    status: Annotated[int, Field(ge=0, le=999)] | None = None
    bytes_sent: Annotated[int, Field(ge=0, le=MAX_BIGINT)] = Field(
        default=0, validation_alias=AliasChoices("bytes_sent", "request_bytes")
    )
    bytes_received: Annotated[int, Field(ge=0, le=MAX_BIGINT)] = Field(
        default=0, validation_alias=AliasChoices("bytes_received", "response_bytes")
    )
    duration_ms: Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)] = 0.0
    scan_rule_ids: list[Annotated[str, Field(pattern=_RULE)]] = Field(
        default_factory=list, max_length=MAX_RULE_IDS
    )
    injected_headers: list[Annotated[str, Field(pattern=_HEADER_NAME)]] = Field(
        default_factory=list, max_length=MAX_HEADERS
    )
    detail: Annotated[str, _printable(MAX_DETAIL)] | None = None
    # LLM usage an Anthropic- or OpenAI-shaped API reported in this response (proxy.md, LLM
    # usage); absent for every other exchange, and when the reported usage was not believable.
    llm_model: Annotated[str, _printable(MAX_MODEL)] | None = None
    llm_input_tokens: Tokens | None = None
    llm_output_tokens: Tokens | None = None
    llm_cache_read_tokens: Tokens | None = None
    llm_cache_write_tokens: Tokens | None = None
    truncated: list[Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")]] = Field(
        default_factory=list,
        max_length=32,
        description="Fields whose value was cut or had characters replaced to fit this schema.",
    )

    @classmethod
    def build(cls, **fields: Any) -> TrafficRecord:
        """A record from whatever the proxy observed: never raises for sandbox-controlled text.

        Strings are cut to their limit and control characters replaced (the field is then listed
        in `truncated`); empty strings become absent. Structural mistakes by the proxy itself
        (an unknown field, a non-number port) still raise, as they are bugs, not input."""
        cut: list[str] = list(fields.pop("truncated", []) or [])
        if isinstance(fields.get("time"), int | float):
            fields["time"] = datetime.fromtimestamp(float(fields["time"]), UTC)
        for alias, name in (
            ("host_header", "host"),
            ("request_bytes", "bytes_sent"),
            ("response_bytes", "bytes_received"),
        ):
            if alias in fields:
                fields[name] = fields.pop(alias)
        for name, limit in _TEXT_LIMITS.items():
            value = fields.get(name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise TypeError(f"{name}: expected text, got {type(value).__name__}")
            fixed = _CONTROL.sub("\ufffd", _escape_surrogates(value))[:limit]
            if name == "method":
                fixed = _TOKEN_CHARS.sub("_", fixed)
            elif name == "reason":
                fixed = re.sub(r"[^a-z0-9_]", "_", fixed.lower())
            elif name == "rule_id":
                fixed = _RULE_CHARS.sub("_", fixed)
            if fixed != value:
                cut.append(name)
            fields[name] = fixed or None
        for name, limit, item_limit, chars in _LIST_LIMITS:
            items = fields.get(name)
            if not items:
                continue
            fixed_items = [
                chars.sub(
                    "_" if chars is not _CONTROL else "\ufffd", _escape_surrogates(str(item))
                )[:item_limit]
                for item in items[:limit]
            ]
            fixed_items = [item for item in fixed_items if item]
            if fixed_items != list(items):
                cut.append(name)
            fields[name] = fixed_items
        for _ in range(3):
            if cut:
                fields["truncated"] = sorted(set(cut))
            try:
                return cls.model_validate(fields)
            except ValidationError as exc:
                # A value that still does not fit (e.g. an empty team) is dropped and marked,
                # never allowed to fail the proxy's request path; required fields stay errors.
                bad = {str(e["loc"][0]) for e in exc.errors() if e["loc"]} - _REQUIRED
                if not bad or not bad <= set(fields):
                    raise
                for name in bad:
                    fields.pop(name)
                    cut.append(name)
        return cls.model_validate(fields)

    def wire(self) -> dict[str, Any]:
        """The JSON-ready form both the spool and the batch use."""
        return self.model_dump(mode="json", exclude_defaults=False)


_REQUIRED = frozenset({"decision", "truncated"})
_TEXT_LIMITS = {
    "method": MAX_METHOD,
    "connect_host": MAX_HOST,
    "sni": MAX_HOST,
    "host": MAX_HOST,
    "path": MAX_PATH,
    "owner": MAX_OWNER,
    "detail": MAX_DETAIL,
    "reason": 64,
    "rule_id": MAX_RULE,
    "llm_model": MAX_MODEL,
}
_LIST_LIMITS = (
    ("query_keys", MAX_QUERY_KEYS, MAX_QUERY_KEY, _CONTROL),
    ("scan_rule_ids", MAX_RULE_IDS, MAX_RULE, _RULE_CHARS),
    ("injected_headers", MAX_HEADERS, 128, _TOKEN_CHARS),
)


class TrafficBatch(BaseModel):
    """What the shipper POSTs. Records stay raw JSON here: the Console validates each on its own."""

    model_config = ConfigDict(extra="forbid")

    records: list[Any] = Field(min_length=1, max_length=MAX_BATCH_RECORDS)


class ValidBatch(BaseModel):
    """The fast path: a batch whose every record validates (checked in one pass, from bytes)."""

    model_config = ConfigDict(extra="forbid")

    records: list[TrafficRecord] = Field(min_length=1, max_length=MAX_BATCH_RECORDS)


class QuarantineReason(StrEnum):
    INVALID = "invalid"  # does not validate against TrafficRecord
    FOREIGN_TEAM = "foreign_team"  # names a team other than the Security CVM's
    UNKNOWN_CVM = "unknown_cvm"  # names a Dev CVM that is not in the team


def describe(error: ValidationError) -> str:
    """Where and why a record failed, never the submitted values."""
    parts = []
    for item in error.errors(include_input=False, include_url=False)[:8]:
        where = location(item["loc"], "record")
        parts.append(f"{where}: {item['type']}")
    return "; ".join(parts)
