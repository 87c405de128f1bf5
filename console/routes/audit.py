"""The audit log, read by team admins (appends happen inside the actions themselves)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.routes.common import TeamPath
from umbra.console.schemas import AuditPage
from umbra.console.services import audit as audit_service

router = APIRouter(prefix="/api/v1/teams/{team}/audit", tags=["audit"])


@router.get("", summary="The team's audit entries in chain order (admin).")
def list_audit(
    team: TeamPath,
    console: ConsoleDep,
    user: UserDep,
    after: Annotated[int, Query(ge=0, le=(1 << 31) - 1)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> AuditPage:
    return audit_service.entries(console=console, user=user, team=team, after=after, limit=limit)
