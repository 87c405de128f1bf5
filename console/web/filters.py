"""Parsing the traffic page's filters from a query string: bounded, validated, clear errors.

Anything a user types into a filter box arrives here; a value that cannot match any stored record
(too long, control characters, a malformed id or time) is refused with a message naming the field
instead of reaching the database.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

from umbra.console.schemas import CVM_ID_PATTERN
from umbra.console.services.traffic import TrafficFilters
from umbra.contracts.traffic import Decision

MAX_VALUE = 255
_PRINTABLE = re.compile(r"^[^\x00-\x1f\x7f]+$")
_CVM_ID = re.compile(CVM_ID_PATTERN)
_REASON = re.compile(r"^[a-z0-9_]{1,64}$")
_CURSOR = re.compile(r"^[A-Za-z0-9_-]{1,512}$")
_RANGES = {"15m": 900, "1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400}


class FilterError(ValueError):
    """A filter value that is refused; the message names the field."""


def _text(name: str, value: str) -> str:
    if len(value) > MAX_VALUE:
        raise FilterError(f"{name}: at most {MAX_VALUE} characters")
    if not _PRINTABLE.match(value):
        raise FilterError(f"{name}: control characters are not allowed")
    return value


def _time(name: str, value: str) -> datetime:
    if len(value) > 40:
        raise FilterError(f"{name}: not a time (use YYYY-MM-DDTHH:MM, UTC)")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise FilterError(f"{name}: not a time (use YYYY-MM-DDTHH:MM, UTC)") from None
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC)
    try:
        return parsed.astimezone(UTC)
    except (OverflowError, ValueError):
        raise FilterError(f"{name}: out of range") from None


def parse_filters(params: Mapping[str, str], now: datetime | None = None) -> TrafficFilters:
    values = {key: value.strip() for key, value in params.items() if value.strip()}
    out: dict[str, object] = {}
    if "range" in values:
        if values["range"] not in _RANGES:
            raise FilterError(f"range: one of {', '.join(_RANGES)}")
        out["range"] = values["range"]
        out["since"] = (now or datetime.now(UTC)) - timedelta(seconds=_RANGES[values["range"]])
    else:
        for name in ("since", "until"):
            if name in values:
                out[name] = _time(name, values[name])
    if "cvm" in values:
        if not _CVM_ID.match(values["cvm"]):
            raise FilterError("cvm: not a CVM id (cvm_ followed by 16 hex digits)")
        out["cvm"] = values["cvm"]
    for name in ("owner", "host", "rule"):
        if name in values:
            out[name] = _text(name, values[name])
    if "decision" in values:
        if values["decision"] not in tuple(Decision):
            raise FilterError("decision: allow or deny")
        out["decision"] = Decision(values["decision"])
    if "reason" in values:
        if not _REASON.match(values["reason"]):
            raise FilterError("reason: lowercase letters, digits and _ (at most 64)")
        out["reason"] = values["reason"]
    if "cursor" in values:
        if not _CURSOR.match(values["cursor"]):
            raise FilterError("cursor: not a cursor this page produced")
        out["cursor"] = values["cursor"]
    return TrafficFilters(**out)  # type: ignore[arg-type]


RANGE_CHOICES = tuple(_RANGES)
