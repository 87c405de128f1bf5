"""The audit log, read by team admins (appends happen inside the actions themselves)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import select
from sqlmodel import col

from umbra.console.db import as_utc
from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.enums import Role
from umbra.console.models import AuditEntry
from umbra.console.routes.common import TeamPath
from umbra.console.schemas import AuditEntryOut, AuditPage
from umbra.console.services.access import require_role

router = APIRouter(prefix="/api/v1/teams/{team}/audit", tags=["audit"])


@router.get("", summary="The team's audit entries in chain order (admin).")
def list_audit(
    team: TeamPath,
    console: ConsoleDep,
    user: UserDep,
    after: Annotated[int, Query(ge=0, le=(1 << 31) - 1)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> AuditPage:
    require_role(user, team, Role.admin)
    with console.session() as session:
        rows = list(
            session.execute(
                select(AuditEntry)
                .where(col(AuditEntry.team) == team, col(AuditEntry.seq) > after)
                .order_by(col(AuditEntry.seq))
                .limit(limit + 1)
            ).scalars()
        )
    more = len(rows) > limit
    rows = rows[:limit]
    entries = [
        AuditEntryOut.model_validate({**row.model_dump(), "time": as_utc(row.time)}) for row in rows
    ]
    return AuditPage(entries=entries, next_cursor=rows[-1].seq if more else None)
