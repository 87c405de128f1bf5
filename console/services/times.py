"""Time filters from a request: `since`/`until` in UTC (naive times are UTC), refused by name."""

from __future__ import annotations

from datetime import datetime

from umbra.console.schemas import to_utc
from umbra.console.services.errors import Invalid


def utc_bound(value: datetime | None, name: str) -> datetime | None:
    if value is None:
        return None
    try:
        return to_utc(value)
    except ValueError as exc:
        raise Invalid(f"{name}: {exc}") from None
