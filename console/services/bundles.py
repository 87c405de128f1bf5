"""Policy bundles: an admin uploads a signed bundle for the team (verified, serial above the
current one, still composing every attachment and the team defaults); members list them."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console import audit
from umbra.console.enums import AuditAction, CvmKind, CvmState, Role
from umbra.console.models import Cvm, PolicyBundle
from umbra.console.schemas import BundleInfo
from umbra.console.services import team_defaults
from umbra.console.services.access import User, policy_lock, require_role
from umbra.console.services.errors import Conflict, Invalid
from umbra.console.services.policy import current_bundle
from umbra.console.state import Console
from umbra.policy.bundle import BundleError, VerifiedBundle, verify_bundle

MAX_SERIAL = (1 << 63) - 1


@dataclass(frozen=True)
class Stored:
    info: BundleInfo
    created: bool  # False: the same bundle was already current (idempotent re-upload)


def bundle_info(row: PolicyBundle) -> BundleInfo:
    return BundleInfo.model_validate(row.model_dump(exclude={"raw", "id"}))


def upload(*, console: Console, user: User, team: str, raw: bytes) -> Stored:
    require_role(user, team, Role.admin)
    try:
        bundle = verify_bundle(raw, console.bundle_keys)
    except BundleError as exc:
        raise Invalid(f"bundle: {exc}") from None
    if bundle.serial > MAX_SERIAL:
        raise Invalid("bundle: serial is too large")
    with console.write(policy_lock(team)) as session:
        current = current_bundle(session, team)
        if current is not None:
            if bundle.serial == current.serial and bundle.hash == current.hash:
                return Stored(bundle_info(current), created=False)
            if bundle.serial <= current.serial:
                raise Conflict(
                    f"bundle serial {bundle.serial} is not above the current serial "
                    f"{current.serial} for team {team!r}"
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
    return Stored(info, created=True)


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
        raise Conflict(
            "the new bundle does not provide composable profiles for CVMs "
            + ", ".join(sorted(broken))
            + "; change their attachments first"
        )
    defaults = team_defaults.default_profiles(session, team)
    if defaults:
        try:
            bundle.compose(defaults)
        except BundleError:
            raise Conflict(
                "the new bundle does not provide the team's default profiles "
                f"({', '.join(defaults)}); change them first (umbra profile detach --team-default)"
            ) from None


def listing(*, console: Console, user: User, team: str) -> list[BundleInfo]:
    """The team's bundles, newest first (at most 100)."""
    require_role(user, team, Role.admin, Role.developer)
    with console.session() as session:
        rows = session.execute(
            select(PolicyBundle)
            .where(col(PolicyBundle.team) == team)
            .order_by(col(PolicyBundle.serial).desc())
            .limit(100)
        ).scalars()
        return [bundle_info(row) for row in rows]
