"""Who may do what: the caller, their role in a team, the CVMs they may see, and the named locks
every writer of one thing takes."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy.orm import Session

from umbra.console.enums import Role
from umbra.console.models import Cvm
from umbra.console.services.errors import Forbidden, not_found

CREDENTIAL_PREFIX = "umbra_scvm_"


def credential_hash(token: str) -> str:
    """How a CVM credential is stored (only its SHA-256)."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class User:
    subject: str
    roles: Mapping[str, Role]

    def role_in(self, team: str) -> Role | None:
        return self.roles.get(team)


def require_role(user: User, team: str, *allowed: Role) -> Role:
    role = user.role_in(team)
    if role is None:
        raise Forbidden(f"not a member of team {team!r}")
    if role not in allowed:
        raise Forbidden(f"role {role.value!r} in team {team!r} may not do this")
    return role


def member(user: User, team: str) -> Role:
    """Any role in the team (admin or developer)."""
    return require_role(user, team, Role.admin, Role.developer)


def visible_cvm(session: Session, user: User, cvm_id: str, team: str | None = None) -> Cvm:
    """The CVM if the caller may see it: admins of its team, or the developer who owns it (and,
    given `team`, only in that team). Anyone else gets the same answer as for a CVM that does not
    exist, so ids do not leak."""
    cvm = session.get(Cvm, cvm_id)
    if cvm is None or (team is not None and cvm.team != team):
        raise not_found(f"CVM {cvm_id}")
    role = user.role_in(cvm.team)
    if role == Role.admin or (role == Role.developer and cvm.owner == user.subject):
        return cvm
    raise not_found(f"CVM {cvm_id}")


def policy_lock(team: str) -> str:
    """Taken by bundle uploads and profile attachments: an attachment is checked against the
    bundle that is current when it commits, and an upload against the attachments."""
    return f"team:{team}:policy"


def cvm_lock(cvm_id: str) -> str:
    """Taken by every change to one CVM row (routes and provider outcomes)."""
    return f"cvm:{cvm_id}"
