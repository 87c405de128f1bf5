"""Traffic log: batched, idempotent ingest from Security CVMs; filtered, paginated queries."""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.exceptions import RequestValidationError
from sqlalchemy import Table, and_, or_, select
from starlette.concurrency import run_in_threadpool

from umbra.console import ingest as ingest_service
from umbra.console.db import as_utc
from umbra.console.deps import ConsoleDep, SecurityCvmDep, UserDep, require_role
from umbra.console.models import Cvm, TrafficQuarantine, TrafficRecord
from umbra.console.routes.common import TeamPath
from umbra.console.schemas import (
    CVM_ID_PATTERN,
    IngestResult,
    QuarantinedRecord,
    QuarantinePage,
    TrafficPage,
    TrafficRecordOut,
    to_utc,
)
from umbra.console.state import Console

router = APIRouter(prefix="/api/v1", tags=["traffic"])
UNPROCESSABLE = status.HTTP_422_UNPROCESSABLE_CONTENT
PRINTABLE = r"^[^\x00-\x1f\x7f]+$"
TABLE: Table = TrafficRecord.__table__  # type: ignore[attr-defined]
QUARANTINE: Table = TrafficQuarantine.__table__  # type: ignore[attr-defined]


INGEST_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TrafficBatch"}}},
    }
}


@router.post(
    "/traffic/batches",
    summary="Ingest a batch of traffic records from a Security CVM (idempotent by record id "
    "within the team; a record that cannot be stored is quarantined, never refused).",
    openapi_extra=INGEST_BODY,
)
async def ingest(request: Request, caller: SecurityCvmDep, console: ConsoleDep) -> IngestResult:
    # The body is parsed and validated by pydantic-core straight from bytes (no json.loads and
    # no per-record model_dump): this endpoint takes tens of thousands of records a second.
    raw = await request.body()
    return await run_in_threadpool(_ingest, raw, caller, console)


def _ingest(raw: bytes, caller: Cvm, console: Console) -> IngestResult:
    try:
        with console.write() as session:
            outcome = ingest_service.ingest(
                session, raw, caller.team, caller.id, console.settings.max_traffic_batch_records
            )
    except ingest_service.BatchRejected as exc:
        raise RequestValidationError(exc.errors) from None
    console.metrics.traffic_inserted.inc(outcome.inserted)
    console.metrics.traffic_duplicates.inc(outcome.duplicates)
    return IngestResult(
        received=outcome.received,
        inserted=outcome.inserted,
        duplicates=outcome.duplicates,
        quarantined=outcome.quarantined,
    )


@router.get(
    "/teams/{team}/traffic/quarantine",
    summary="Shipped records the Console could not store, with the reason (admin), newest first.",
)
def list_quarantine(
    team: TeamPath,
    console: ConsoleDep,
    user: UserDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[int | None, Query(ge=1, le=(1 << 31) - 1)] = None,
) -> QuarantinePage:
    require_role(user, team, "admin")
    columns = QUARANTINE.c
    query = select(TrafficQuarantine).where(columns.team == team)
    if cursor is not None:
        query = query.where(columns.id < cursor)
    query = query.order_by(columns.id.desc()).limit(limit + 1)
    with console.session() as session:
        rows = list(session.execute(query).scalars())
    more = len(rows) > limit
    rows = rows[:limit]
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


def _encode_cursor(record: TrafficRecord) -> str:
    raw = json.dumps([as_utc(record.time).isoformat(), record.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        when, record_id = json.loads(raw)
        return to_utc(datetime.fromisoformat(when)), str(record_id)
    except (binascii.Error, ValueError, TypeError, OverflowError):
        raise HTTPException(UNPROCESSABLE, "cursor: not a cursor this API returned") from None


def _utc(value: datetime | None, name: str) -> datetime | None:
    if value is None:
        return None
    try:
        return to_utc(value)
    except ValueError as exc:
        raise HTTPException(UNPROCESSABLE, f"{name}: {exc}") from None


@router.get(
    "/teams/{team}/traffic",
    summary="Query traffic records, newest first (admin: the team; developer: own CVMs).",
)
def query_traffic(
    team: TeamPath,
    console: ConsoleDep,
    user: UserDep,
    cvm_id: Annotated[str | None, Query(pattern=CVM_ID_PATTERN)] = None,
    owner: Annotated[str | None, Query(min_length=1, max_length=255, pattern=PRINTABLE)] = None,
    host: Annotated[str | None, Query(min_length=1, max_length=255, pattern=PRINTABLE)] = None,
    decision: Literal["allow", "deny"] | None = None,
    reason: Annotated[str | None, Query(pattern=r"^[a-z0-9_]{1,64}$")] = None,
    rule_id: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9._:/-]{1,160}$")] = None,
    since: Annotated[datetime | None, Query(description="Inclusive; naive times are UTC.")] = None,
    until: Annotated[datetime | None, Query(description="Exclusive; naive times are UTC.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> TrafficPage:
    role = require_role(user, team, "admin", "developer")
    if role != "admin":
        if owner is not None and owner != user.subject:
            raise HTTPException(
                status.HTTP_403_FORBIDDEN, "owner: developers see their own traffic"
            )
        owner = user.subject
    return _query(
        console,
        team,
        cvm_id,
        owner,
        host,
        decision,
        reason,
        rule_id,
        _utc(since, "since"),
        _utc(until, "until"),
        limit,
        cursor,
    )


def _query(
    console: Console,
    team: str,
    cvm_id: str | None,
    owner: str | None,
    host: str | None,
    decision: str | None,
    reason: str | None,
    rule_id: str | None,
    since: datetime | None,
    until: datetime | None,
    limit: int,
    cursor: str | None,
) -> TrafficPage:
    columns = TABLE.c
    query = select(TrafficRecord).where(columns.team == team)
    for column, value in (
        (columns.cvm_id, cvm_id),
        (columns.owner, owner),
        (columns.host, host),
        (columns.decision, decision),
        (columns.reason, reason),
        (columns.rule_id, rule_id),
    ):
        if value is not None:
            query = query.where(column == value)
    if since is not None:
        query = query.where(columns.time >= since)
    if until is not None:
        query = query.where(columns.time < until)
    if cursor is not None:
        when, record_id = _decode_cursor(cursor)
        query = query.where(
            or_(columns.time < when, and_(columns.time == when, columns.id < record_id))
        )
    query = query.order_by(columns.time.desc(), columns.id.desc()).limit(limit + 1)
    with console.session() as session:
        rows = list(session.execute(query).scalars())
    more = len(rows) > limit
    rows = rows[:limit]
    records = [
        TrafficRecordOut.model_validate(
            {**row.model_dump(exclude={"received_at"}), "time": as_utc(row.time)}
        )
        for row in rows
    ]
    return TrafficPage(records=records, next_cursor=_encode_cursor(rows[-1]) if more else None)
