"""Helpers shared by route modules: team path parameter, CVM visibility, locks, bundles."""

from __future__ import annotations

from typing import Annotated

from fastapi import HTTPException, Path, status
from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console.deps import User
from umbra.console.models import Cvm, PolicyBundle
from umbra.console.schemas import CVM_ID_PATTERN, NAME_PATTERN, CvmInfo
from umbra.console.state import Console
from umbra.policy.bundle import BundleError

TeamPath = Annotated[str, Path(pattern=NAME_PATTERN, description="Team name.")]
CvmIdPath = Annotated[str, Path(pattern=CVM_ID_PATTERN, description="CVM id.")]


def policy_lock(team: str) -> str:
    """Taken by bundle uploads and profile attachments: an attachment is checked against the
    bundle that is current when it commits, and an upload against the attachments."""
    return f"team:{team}:policy"


def cvm_lock(cvm_id: str) -> str:
    """Taken by every change to one CVM row (routes and provider outcomes)."""
    return f"cvm:{cvm_id}"


def not_found(what: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what} not found")


def visible_cvm(session: Session, user: User, cvm_id: str) -> Cvm:
    """The CVM if the caller may see it: admins of its team, or the developer who owns it.

    Anyone else gets the same 404 as for a CVM that does not exist, so ids do not leak."""
    cvm = session.get(Cvm, cvm_id)
    if cvm is None:
        raise not_found(f"CVM {cvm_id}")
    role = user.role_in(cvm.team)
    if role == "admin" or (role == "developer" and cvm.owner == user.subject):
        return cvm
    raise not_found(f"CVM {cvm_id}")


def cvm_info(cvm: Cvm) -> CvmInfo:
    return CvmInfo.model_validate(cvm.model_dump(exclude={"credential_hash", "created_by"}))


def current_bundle(session: Session, team: str) -> PolicyBundle | None:
    return session.execute(
        select(PolicyBundle)
        .where(col(PolicyBundle.team) == team)
        .order_by(col(PolicyBundle.serial).desc())
        .limit(1)
    ).scalar_one_or_none()


def check_profiles_compose(
    console: Console, session: Session, team: str, profiles: list[str]
) -> None:
    """Profiles to attach (to a CVM, or as team defaults) must compose in the team's current
    bundle; call it holding `policy_lock(team)` so the bundle cannot change before commit."""
    if not profiles:
        return
    bundle_row = current_bundle(session, team)
    if bundle_row is None:
        raise HTTPException(status.HTTP_409_CONFLICT, f"team {team!r} has no policy bundle yet")
    try:
        console.verified(bundle_row.hash, bundle_row.raw).compose(profiles)
    except BundleError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"profiles: {exc}") from None
