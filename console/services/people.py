"""People who leave, and come back: `deactivate` a developer in a team, `reactivate` them (admin).

In one transaction: the subject is recorded in `deactivated_user` (their OIDC tokens and web
sessions carry no role in the team from the next request on: `active_roles`, applied where a
request's user is built), their personal secrets in the team are erased (rows deleted, not
flagged), and `user.deactivate` is audited with what was erased. Then each of their Dev CVMs in
the team is detached (no profiles: its egress is closed at the next attachments poll) and
stopped, each change audited as an admin's would be; a CVM busy with a provider run is reported
`skipped` with the reason, and deactivating again retries it (idempotent).

Reactivating deletes the `deactivated_user` row (audited `user.reactivate`): their tokens carry
their IdP roles in the team again from the next request on. Nothing else is undone: erased
secrets are gone, their CVMs stay detached and as they are (idempotent: `newly` false when they
were not deactivated).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import delete, select
from sqlmodel import col

from umbra.console import audit
from umbra.console.enums import AuditAction, CvmKind, CvmState, Power, Role, Scope
from umbra.console.models import Cvm, DeactivatedUser, Secret, utcnow
from umbra.console.services import cvms
from umbra.console.services.access import User, require_role
from umbra.console.services.errors import Invalid, ServiceError
from umbra.console.state import Console


@dataclass
class Deactivation:
    team: str
    subject: str
    newly: bool  # False: they were already deactivated (CVMs are still retried)
    secrets_erased: int
    cvms_detached: list[str] = field(default_factory=list)
    cvms_stopped: list[str] = field(default_factory=list)
    cvms_skipped: dict[str, str] = field(default_factory=dict)


def user_lock(team: str, subject: str) -> str:
    return f"user:{team}:{subject}"


def active_roles(console: Console, subject: str, roles: dict[str, Role]) -> dict[str, Role]:
    """`roles` without the teams `subject` was deactivated in."""
    if not roles:
        return roles
    with console.session() as session:
        gone = set(
            session.execute(
                select(col(DeactivatedUser.team)).where(col(DeactivatedUser.subject) == subject)
            ).scalars()
        )
    return {team: role for team, role in roles.items() if team not in gone} if gone else roles


def deactivate(*, console: Console, user: User, team: str, subject: str) -> Deactivation:
    require_role(user, team, Role.admin)
    if subject == user.subject:
        raise Invalid("subject: an admin cannot deactivate themselves")
    with console.write(user_lock(team, subject)) as session:
        newly = session.get(DeactivatedUser, (team, subject)) is None
        if newly:
            session.add(
                DeactivatedUser(
                    team=team, subject=subject, deactivated_at=utcnow(),
                    deactivated_by=user.subject,
                )
            )  # fmt: skip
        erased = session.execute(
            delete(Secret).where(
                col(Secret.team) == team,
                col(Secret.scope) == Scope.personal,
                col(Secret.owner) == subject,
            )
        ).rowcount  # type: ignore[attr-defined]
        owned = list(
            session.execute(
                select(col(Cvm.id))
                .where(
                    col(Cvm.team) == team,
                    col(Cvm.owner) == subject,
                    col(Cvm.kind) == CvmKind.dev,
                    col(Cvm.state) != CvmState.destroyed,
                )
                .order_by(col(Cvm.id))
            ).scalars()
        )
        audit.append(
            session, actor=user.subject, team=team, action=AuditAction.user_deactivate,
            target=subject, details={"secrets_erased": int(erased), "cvms": owned,
                                     "already": not newly},
        )  # fmt: skip
    result = Deactivation(team, subject, newly, int(erased))
    for cvm_id in owned:
        try:
            info = cvms.attach_profiles(console=console, user=user, cvm_id=cvm_id, profiles=[])
            result.cvms_detached.append(cvm_id)
            if info.state == CvmState.running:
                cvms.set_power(console=console, user=user, cvm_id=cvm_id, power=Power.stopped)
                result.cvms_stopped.append(cvm_id)
        except ServiceError as exc:
            result.cvms_skipped[cvm_id] = exc.detail
    console.notifier.notify()
    return result


@dataclass
class Reactivation:
    team: str
    subject: str
    newly: bool  # False: they were not deactivated (nothing changed)
    deactivated_at: datetime | None  # the deactivation this undid
    deactivated_by: str | None


def reactivate(*, console: Console, user: User, team: str, subject: str) -> Reactivation:
    require_role(user, team, Role.admin)
    with console.write(user_lock(team, subject)) as session:
        row = session.get(DeactivatedUser, (team, subject))
        at, by = (row.deactivated_at, row.deactivated_by) if row is not None else (None, None)
        if row is not None:
            session.delete(row)
        audit.append(
            session, actor=user.subject, team=team, action=AuditAction.user_reactivate,
            target=subject, details={"already": row is None, "deactivated_by": by,
                                     "deactivated_at": at.isoformat() if at else None},
        )  # fmt: skip
    return Reactivation(team, subject, row is not None, at, by)
