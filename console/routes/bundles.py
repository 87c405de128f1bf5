"""Policy bundles: admins upload signed bundles for their team; members list them."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response, status
from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlmodel import col
from starlette.concurrency import run_in_threadpool

from umbra.console import audit
from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.enums import AuditAction, CvmKind, CvmState, Role
from umbra.console.models import Cvm, PolicyBundle
from umbra.console.routes.common import TeamPath
from umbra.console.schemas import BundleInfo
from umbra.console.services import team_defaults
from umbra.console.services.access import User, policy_lock, require_role
from umbra.console.services.policy import current_bundle
from umbra.console.state import Console
from umbra.policy.bundle import BundleError, VerifiedBundle, verify_bundle

router = APIRouter(prefix="/api/v1/teams/{team}/bundles", tags=["bundles"])
MAX_SERIAL = (1 << 63) - 1

_BUNDLE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        "description": "The signed bundle exactly as `umbra policy bundle` wrote it.",
    }
}


def bundle_info(row: PolicyBundle) -> BundleInfo:
    return BundleInfo.model_validate(row.model_dump(exclude={"raw", "id"}))


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
    require_role(user, team, Role.admin)
    raw = await request.body()
    return await run_in_threadpool(_store, console, user, team, raw, response)


def _store(console: Console, user: User, team: str, raw: bytes, response: Response) -> BundleInfo:
    try:
        bundle = verify_bundle(raw, console.bundle_keys)
    except BundleError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"bundle: {exc}") from None
    if bundle.serial > MAX_SERIAL:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "bundle: serial is too large")
    with console.write(policy_lock(team)) as session:
        current = current_bundle(session, team)
        if current is not None:
            if bundle.serial == current.serial and bundle.hash == current.hash:
                response.status_code = status.HTTP_200_OK
                return bundle_info(current)
            if bundle.serial <= current.serial:
                raise HTTPException(
                    status.HTTP_409_CONFLICT,
                    f"bundle serial {bundle.serial} is not above the current serial "
                    f"{current.serial} for team {team!r}",
                )
        _check_attachments_still_compose(session, team, bundle)
        row = PolicyBundle(
            team=team,
            serial=bundle.serial,
            hash=bundle.hash,
            keyid=bundle.keyid,
            source=bundle.payload.source[:512] if bundle.payload.source else None,
            profiles=bundle.profile_names(),
            raw=raw,
            uploaded_by=user.subject,
        )
        session.add(row)
        audit.append(
            session,
            actor=user.subject,
            team=team,
            action=AuditAction.policy_upload,
            target=bundle.hash,
            details={"serial": bundle.serial, "keyid": bundle.keyid, "profiles": row.profiles},
        )
        session.flush()
        info = bundle_info(row)
    console.notifier.notify()
    return info


def _check_attachments_still_compose(session: Session, team: str, bundle: VerifiedBundle) -> None:
    cvms = session.execute(
        select(Cvm).where(
            col(Cvm.team) == team,
            col(Cvm.kind) == CvmKind.dev,
            col(Cvm.state) != CvmState.destroyed,
        )
    ).scalars()
    broken = []
    for cvm in cvms:
        if not cvm.profiles:
            continue
        try:
            bundle.compose(cvm.profiles)
        except BundleError:
            broken.append(cvm.id)
    if broken:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            "the new bundle does not provide composable profiles for CVMs "
            + ", ".join(sorted(broken))
            + "; change their attachments first",
        )
    defaults = team_defaults.default_profiles(session, team)
    if defaults:
        try:
            bundle.compose(defaults)
        except BundleError:
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                "the new bundle does not provide the team's default profiles "
                f"({', '.join(defaults)}); change them first (umbra profile detach --team-default)",
            ) from None


@router.get("", summary="List the team's bundles, newest first (admin, developer).")
def list_bundles(team: TeamPath, console: ConsoleDep, user: UserDep) -> list[BundleInfo]:
    require_role(user, team, Role.admin, Role.developer)
    with console.session() as session:
        rows = session.execute(
            select(PolicyBundle)
            .where(col(PolicyBundle.team) == team)
            .order_by(col(PolicyBundle.serial).desc())
            .limit(100)
        ).scalars()
        return [bundle_info(row) for row in rows]
