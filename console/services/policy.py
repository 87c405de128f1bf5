"""The team's current policy bundle, and the check that profiles compose in it."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console.models import PolicyBundle
from umbra.console.services.errors import Conflict, Invalid
from umbra.console.state import Console
from umbra.policy.bundle import BundleError


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
        raise Conflict(f"team {team!r} has no policy bundle yet")
    try:
        console.verified(bundle_row.hash, bundle_row.raw).compose(profiles)
    except BundleError as exc:
        raise Invalid(f"profiles: {exc}") from None
