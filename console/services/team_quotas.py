"""Team quotas: how many Dev CVMs each developer may have, and the machine types (a catalog the
admin sets) Dev CVMs may use. Checked in the launch's and the resize's own transaction; Dev CVM
launches of a team hold its policy lock, so parallel launches by one developer count each other
(one defined outcome: exactly the quota's number succeed)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console import audit
from umbra.console.enums import AuditAction, CvmKind, CvmState, Role
from umbra.console.models import Cvm, TeamSettings, utcnow
from umbra.console.schemas import TeamQuotas, TeamQuotasInfo
from umbra.console.services.access import User, policy_lock, require_role
from umbra.console.services.errors import Conflict, Invalid
from umbra.console.state import Console


def _info(team: str, row: TeamSettings | None) -> TeamQuotasInfo:
    if row is None:
        return TeamQuotasInfo(team=team)
    return TeamQuotasInfo(
        team=team,
        max_dev_cvms_per_owner=row.max_dev_cvms_per_owner,
        machine_types=sorted(row.machine_types),
        updated_by=row.updated_by,
        updated_at=row.updated_at,
    )


def get(*, console: Console, user: User, team: str) -> TeamQuotasInfo:
    require_role(user, team, Role.admin, Role.developer)  # developers see their limits
    with console.session() as session:
        return _info(team, session.get(TeamSettings, team))


def put(*, console: Console, user: User, team: str, quotas: TeamQuotas) -> TeamQuotasInfo:
    """Set the limits (audited). CVMs over a lowered limit keep running; new launches wait."""
    require_role(user, team, Role.admin)
    with console.write(policy_lock(team)) as session:
        row = session.get(TeamSettings, team)
        if row is None:
            row = TeamSettings(team=team, updated_by=user.subject)
        previous = _info(team, row).model_dump(include={"max_dev_cvms_per_owner", "machine_types"})
        row.max_dev_cvms_per_owner = quotas.max_dev_cvms_per_owner
        row.machine_types = sorted(set(quotas.machine_types))
        row.updated_by, row.updated_at = user.subject, utcnow()
        session.add(row)
        audit.append(
            session, actor=user.subject, team=team, action=AuditAction.team_quotas, target=team,
            details={"max_dev_cvms_per_owner": row.max_dev_cvms_per_owner,
                     "machine_types": row.machine_types, "previous": previous},
        )  # fmt: skip
        session.flush()
        return _info(team, row)


def check_machine_type(session: Session, team: str, size: str | None) -> None:
    row = session.get(TeamSettings, team)
    if row is None or not row.machine_types or size is None:
        return
    if size not in row.machine_types:
        raise Invalid(
            f"size: {size!r} is not in the team's machine types ({', '.join(row.machine_types)})"
        )


def check_launch(session: Session, team: str, owner: str, size: str | None) -> None:
    """Call inside the Dev CVM launch's transaction, holding the team's policy lock."""
    check_machine_type(session, team, size)
    row = session.get(TeamSettings, team)
    if row is None or row.max_dev_cvms_per_owner is None:
        return
    count = session.execute(
        select(func.count())
        .select_from(Cvm)
        .where(
            col(Cvm.team) == team,
            col(Cvm.owner) == owner,
            col(Cvm.kind) == CvmKind.dev,
            col(Cvm.state) != CvmState.destroyed,
        )
    ).scalar_one()
    if count >= row.max_dev_cvms_per_owner:
        raise Conflict(
            f"quota: {owner} has {count} Dev CVMs, the team's limit is "
            f"{row.max_dev_cvms_per_owner}; destroy one first"
        )
