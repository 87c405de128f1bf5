"""Team default profiles: what the Console attaches to every Dev CVM it launches for a team.

The attachment happens in the launch's own transaction, before any provider runs, so it is the
same for every provider (local or cloud). Setting the defaults and launching both hold the team's
policy lock (`services.access.policy_lock`), as do bundle uploads: a launch gets exactly the defaults
committed before it, never a mix, and the defaults always compose in the current bundle.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from umbra.console import audit
from umbra.console.enums import AuditAction, Role
from umbra.console.models import TeamSettings, utcnow
from umbra.console.schemas import TeamDefaultProfiles, profiles_etag
from umbra.console.services.access import User, policy_lock, require_role
from umbra.console.services.errors import Stale
from umbra.console.services.policy import check_profiles_compose
from umbra.console.state import Console

SOURCE = "team-default"  # audit detail: who chose these profiles for a launched CVM


def _info(team: str, row: TeamSettings | None) -> TeamDefaultProfiles:
    profiles = sorted(row.default_profiles) if row is not None else []
    return TeamDefaultProfiles(
        team=team,
        profiles=profiles,
        etag=profiles_etag(profiles),
        updated_by=row.updated_by if row is not None else None,
        updated_at=row.updated_at if row is not None else None,
    )


def default_profiles(session: Session, team: str) -> list[str]:
    """The team's defaults; call it holding the team's policy lock when attaching them."""
    row = session.get(TeamSettings, team)
    return sorted(row.default_profiles) if row is not None else []


def get(*, console: Console, user: User, team: str) -> TeamDefaultProfiles:
    require_role(user, team, Role.admin)
    with console.session() as session:
        return _info(team, session.get(TeamSettings, team))


def put(
    *, console: Console, user: User, team: str, profiles: list[str], if_match: str | None
) -> TeamDefaultProfiles:
    """Replace the defaults (checked to compose in the current bundle). Already running CVMs keep
    their attachments: defaults apply to launches from now on."""
    require_role(user, team, Role.admin)
    wanted = sorted(set(profiles))
    with console.write(policy_lock(team)) as session:
        row = session.get(TeamSettings, team)
        current = sorted(row.default_profiles) if row is not None else []
        if if_match is not None and if_match.strip('" ') != profiles_etag(current):
            raise Stale(
                f"team {team!r}'s default profiles changed since you read them; read and retry"
            )
        check_profiles_compose(console, session, team, wanted)
        if row is None:
            row = TeamSettings(team=team, updated_by=user.subject)
        row.default_profiles = wanted
        row.updated_by = user.subject
        row.updated_at = utcnow()
        session.add(row)
        audit.append(
            session,
            actor=user.subject,
            team=team,
            action=AuditAction.profiles_defaults,
            target=team,
            details={"profiles": wanted, "previous": current},
        )
        session.flush()
        return _info(team, row)


def audit_attached(
    session: Session, *, actor: str, team: str, cvm_id: str, profiles: list[str]
) -> None:
    """After a launch's own audit entry: which default profiles it was given."""
    if profiles:
        audit.append(
            session,
            actor=actor,
            team=team,
            action=AuditAction.profiles_attach,
            target=cvm_id,
            details={"profiles": profiles, "source": SOURCE},
        )
