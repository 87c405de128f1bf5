"""Traffic log: batched, idempotent ingest from Security CVMs; filtered, paginated queries."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.exceptions import RequestValidationError
from sqlalchemy import Table, select
from starlette.concurrency import run_in_threadpool

from umbra.console import ingest as ingest_service
from umbra.console.db import as_utc
from umbra.console.deps import ConsoleDep, SecurityCvmDep, UserDep
from umbra.console.enums import Role
from umbra.console.models import Cvm, TrafficQuarantine
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
from umbra.console.services import traffic
from umbra.console.services.access import require_role
from umbra.console.state import Console
from umbra.contracts.traffic import Decision

router = APIRouter(prefix="/api/v1", tags=["traffic"])
UNPROCESSABLE = status.HTTP_422_UNPROCESSABLE_CONTENT
PRINTABLE = r"^[^\x00-\x1f\x7f]+$"
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
    require_role(user, team, Role.admin)
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
    decision: Decision | None = None,
    reason: Annotated[str | None, Query(pattern=r"^[a-z0-9_]{1,64}$")] = None,
    rule_id: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9._:/-]{1,160}$")] = None,
    since: Annotated[datetime | None, Query(description="Inclusive; naive times are UTC.")] = None,
    until: Annotated[datetime | None, Query(description="Exclusive; naive times are UTC.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> TrafficPage:
    filters = traffic.scoped(
        user,
        team,
        traffic.TrafficFilters(
            cvm=cvm_id, owner=owner, host=host, decision=decision, reason=reason, rule=rule_id
        ),
    )
    filters = replace(
        filters, since=_utc(since, "since"), until=_utc(until, "until"), cursor=cursor
    )
    page = traffic.page(console=console, team=team, filters=filters, limit=limit)
    records = [
        TrafficRecordOut.model_validate(
            {**row.model_dump(exclude={"received_at", "export_seq"}), "time": as_utc(row.time)}
        )
        for row in page.rows
    ]
    return TrafficPage(records=records, next_cursor=page.next_cursor)
