"""LLM usage: the usage the proxy read from LLM API responses, summed per day, developer, CVM and
model (admin: the team; developer: own usage). The service is `services/usage.py`."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.routes.common import TeamPath
from umbra.console.schemas import CVM_ID_PATTERN, UsageReportOut, UsageRowOut
from umbra.console.services import usage as usage_service
from umbra.console.services.times import utc_bound

router = APIRouter(prefix="/api/v1", tags=["usage"])
PRINTABLE = r"^[^\x00-\x1f\x7f]+$"


@router.get(
    "/teams/{team}/usage",
    summary="LLM token usage per UTC day, developer, CVM and model (admin: the team; "
    "developer: own usage). Default: the last 30 days.",
)
def team_usage(
    team: TeamPath,
    console: ConsoleDep,
    user: UserDep,
    since: Annotated[datetime | None, Query(description="Inclusive; naive times are UTC.")] = None,
    until: Annotated[datetime | None, Query(description="Exclusive; naive times are UTC.")] = None,
    owner: Annotated[str | None, Query(min_length=1, max_length=255, pattern=PRINTABLE)] = None,
    cvm_id: Annotated[str | None, Query(pattern=CVM_ID_PATTERN)] = None,
) -> UsageReportOut:
    report = usage_service.usage(
        console=console,
        user=user,
        team=team,
        since=utc_bound(since, "since"),
        until=utc_bound(until, "until"),
        owner=owner,
        cvm_id=cvm_id,
    )
    rows = [UsageRowOut.model_validate(row, from_attributes=True) for row in report.rows]
    return UsageReportOut(
        since=report.since,
        until=report.until,
        rows=rows,
        totals={name: report.total(name) for name in ("requests", *usage_service.TOKENS)},
    )
