"""Traffic log: batched, idempotent ingest from Security CVMs; filtered, paginated queries
(services/traffic.py)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool

from umbra.console import ingest as ingest_batch
from umbra.console.db import as_utc
from umbra.console.deps import ConsoleDep, SecurityCvmDep, UserDep
from umbra.console.models import Cvm
from umbra.console.routes.common import TeamPath
from umbra.console.schemas import (
    CVM_ID_PATTERN,
    IngestResult,
    QuarantinePage,
    TrafficPage,
    TrafficRecordOut,
)
from umbra.console.services import traffic
from umbra.console.services.times import utc_bound
from umbra.console.state import Console
from umbra.contracts.traffic import Decision

router = APIRouter(prefix="/api/v1", tags=["traffic"])
PRINTABLE = r"^[^\x00-\x1f\x7f]+$"


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
        outcome = traffic.ingest(console=console, team=caller.team, cvm_id=caller.id, raw=raw)
    except ingest_batch.BatchRejected as exc:
        raise RequestValidationError(exc.errors) from None
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
    return traffic.quarantine(console=console, user=user, team=team, limit=limit, cursor=cursor)


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
        filters,
        since=utc_bound(since, "since"),
        until=utc_bound(until, "until"),
        cursor=cursor,
    )
    page = traffic.page(console=console, team=team, filters=filters, limit=limit)
    records = [
        TrafficRecordOut.model_validate(
            {**row.model_dump(exclude={"received_at", "export_seq"}), "time": as_utc(row.time)}
        )
        for row in page.rows
    ]
    return TrafficPage(records=records, next_cursor=page.next_cursor)
