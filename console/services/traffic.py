"""Traffic-log queries shared by the API and the web view: the caller's scope (admins see the
team, developers their own records), filters, keyset pages on (time, id), newer records for the
live view, one record. Pages never count rows, so one costs the same on the first or the
millionth record. Also a Security CVM's batch ingest (console/ingest.py) and the quarantine."""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Select, Table, and_, or_, select
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import col

from umbra.console import ingest as ingest_batch
from umbra.console.db import as_utc
from umbra.console.enums import Role
from umbra.console.models import TrafficQuarantine, TrafficRecord
from umbra.console.schemas import QuarantinedRecord, QuarantinePage, to_utc
from umbra.console.services.access import User, member, require_role
from umbra.console.services.errors import Forbidden, Invalid, not_found
from umbra.console.state import Console
from umbra.contracts.traffic import Decision

TABLE: Table = TrafficRecord.__table__  # type: ignore[attr-defined]
QUARANTINE: Table = TrafficQuarantine.__table__  # type: ignore[attr-defined]
LIVE_LIMIT = 100


@dataclass(frozen=True)
class TrafficFilters:
    since: datetime | None = None
    until: datetime | None = None
    range: str | None = None  # the web view's relative range ("1h"), already turned into since
    cvm: str | None = None
    owner: str | None = None
    host: str | None = None
    decision: Decision | None = None
    reason: str | None = None
    rule: str | None = None
    cursor: str | None = None

    def query(self, **overrides: str | None) -> dict[str, str]:
        """The filters as query parameters (for links), with `overrides` applied."""
        values: dict[str, str] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name in ("since", "until") and value is not None and self.range is not None:
                continue  # a relative range is re-evaluated on each load
            if isinstance(value, datetime):
                value = value.strftime("%Y-%m-%dT%H:%M")
            if value is not None:
                values[item.name] = str(value)
        for key, override in overrides.items():
            if override is None:
                values.pop(key, None)
            else:
                values[key] = override
        return values


@dataclass(frozen=True)
class Page:
    rows: list[TrafficRecord]
    next_cursor: str | None


def encode_cursor(record: TrafficRecord) -> str:
    raw = json.dumps([as_utc(record.time).isoformat(), record.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        when, record_id = json.loads(raw)
        return to_utc(datetime.fromisoformat(when)), str(record_id)
    except (binascii.Error, ValueError, TypeError, OverflowError):
        raise Invalid("cursor: not a cursor this API returned") from None


def scoped(user: User, team: str, filters: TrafficFilters) -> TrafficFilters:
    """The traffic rule: admins see the team, developers only their own records."""
    if member(user, team) == Role.admin:
        return filters
    if filters.owner is not None and filters.owner != user.subject:
        raise Forbidden("owner: developers see their own traffic")
    return replace(filters, owner=user.subject)


def where(team: str, filters: TrafficFilters) -> list[ColumnElement[bool]]:
    c = TABLE.c
    clauses: list[ColumnElement[bool]] = [c.team == team]
    for column, value in (
        (c.cvm_id, filters.cvm),
        (c.owner, filters.owner),
        (c.host, filters.host),
        (c.decision, filters.decision),
        (c.reason, filters.reason),
        (c.rule_id, filters.rule),
    ):
        if value is not None:
            clauses.append(column == value)
    if filters.since is not None:
        clauses.append(c.time >= filters.since)
    if filters.until is not None:
        clauses.append(c.time < filters.until)
    return clauses


def _keyset_page(console: Console, query: Select[Any], limit: int) -> tuple[list[Any], bool]:
    """The first `limit` rows of an ordered query, and whether more follow (one row more is read:
    no count)."""
    with console.session() as session:
        rows = list(session.execute(query.limit(limit + 1)).scalars())
    return rows[:limit], len(rows) > limit


def page(*, console: Console, team: str, filters: TrafficFilters, limit: int) -> Page:
    """Newest first, `limit` records after `filters.cursor`; call with `scoped` filters."""
    c = TABLE.c
    query = select(TrafficRecord).where(*where(team, filters))
    if filters.cursor is not None:
        when, record_id = decode_cursor(filters.cursor)
        query = query.where(or_(c.time < when, and_(c.time == when, c.id < record_id)))
    rows, more = _keyset_page(console, query.order_by(c.time.desc(), c.id.desc()), limit)
    return Page(rows, encode_cursor(rows[-1]) if more and rows else None)


def newer(
    *, console: Console, team: str, filters: TrafficFilters, after: str | None
) -> list[TrafficRecord]:
    """Records after the cursor `after` (oldest first), or the newest ones, for the live view."""
    c = TABLE.c
    query = select(TrafficRecord).where(*where(team, filters))
    if after is not None:
        when, record_id = decode_cursor(after)
        query = query.where(or_(c.time > when, and_(c.time == when, c.id > record_id)))
        query = query.order_by(c.time.asc(), c.id.asc())
    else:
        query = query.order_by(c.time.desc(), c.id.desc())
    with console.session() as session:
        rows = list(session.execute(query.limit(LIVE_LIMIT)).scalars())
    return rows if after is not None else rows[::-1]


def record(*, console: Console, user: User, team: str, record_id: str) -> TrafficRecord:
    """One record, visible under the same rule as the traffic list; anything else is NotFound."""
    role = member(user, team)
    try:
        key = str(uuid.UUID(record_id))
    except ValueError:
        raise not_found("traffic record") from None
    with console.session() as session:
        # The key is (team, id, time) (revision 0015); a shipper never reuses an id, so one row.
        row = session.execute(
            select(TrafficRecord)
            .where(col(TrafficRecord.team) == team, col(TrafficRecord.id) == key)
            .limit(1)
        ).scalar_one_or_none()
    if row is None or row.team != team or (role != Role.admin and row.owner != user.subject):
        raise not_found("traffic record")
    return row


def ingest(*, console: Console, team: str, cvm_id: str, raw: bytes) -> ingest_batch.IngestOutcome:
    """Store a Security CVM's batch (bytes as received); raises `ingest.BatchRejected` for a body
    that is not a batch at all (the route answers it as a request validation error)."""
    with console.write() as session:
        outcome = ingest_batch.ingest(
            session, raw, team, cvm_id, console.settings.max_traffic_batch_records
        )
    console.metrics.traffic_inserted.inc(outcome.inserted)
    console.metrics.traffic_duplicates.inc(outcome.duplicates)
    return outcome


def quarantine(
    *, console: Console, user: User, team: str, limit: int, cursor: int | None
) -> QuarantinePage:
    """Shipped records that could not be stored, newest first (admin); `cursor` is an id."""
    require_role(user, team, Role.admin)
    columns = QUARANTINE.c
    query = select(TrafficQuarantine).where(columns.team == team)
    if cursor is not None:
        query = query.where(columns.id < cursor)
    rows, more = _keyset_page(console, query.order_by(columns.id.desc()), limit)
    return QuarantinePage(
        records=[
            QuarantinedRecord.model_validate(
                {
                    **row.model_dump(exclude={"team", "fingerprint"}),
                    "received_at": as_utc(row.received_at),
                }
            )
            for row in rows
        ],
        next_cursor=rows[-1].id if more and rows[-1].id is not None else None,
    )
