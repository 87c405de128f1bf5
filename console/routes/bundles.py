"""Policy bundles: admins upload signed bundles for their team; members list them
(services/bundles.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from starlette.concurrency import run_in_threadpool

from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.enums import Role
from umbra.console.routes.common import TeamPath
from umbra.console.schemas import BundleInfo
from umbra.console.services import bundles
from umbra.console.services.access import require_role

router = APIRouter(prefix="/api/v1/teams/{team}/bundles", tags=["bundles"])

_BUNDLE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        "description": "The signed bundle exactly as `umbra policy bundle` wrote it.",
    }
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    summary="Upload a signed policy bundle (admin).",
    openapi_extra=_BUNDLE_BODY,
    responses={200: {"model": BundleInfo, "description": "Same bundle already current"}},
)
async def upload_bundle(
    team: TeamPath, request: Request, response: Response, console: ConsoleDep, user: UserDep
) -> BundleInfo:
    require_role(user, team, Role.admin)  # before reading a body a non-admin may not send
    raw = await request.body()
    stored = await run_in_threadpool(
        lambda: bundles.upload(console=console, user=user, team=team, raw=raw)
    )
    if not stored.created:
        response.status_code = status.HTTP_200_OK
    return stored.info


@router.get("", summary="List the team's bundles, newest first (admin, developer).")
def list_bundles(team: TeamPath, console: ConsoleDep, user: UserDep) -> list[BundleInfo]:
    return bundles.listing(console=console, user=user, team=team)
