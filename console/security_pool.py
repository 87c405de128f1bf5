"""A team's Security CVM pool: the replicas its team stack runs behind one internal load balancer.

Each replica is its own CVM record with its own enrolled credential (its own `umbra.cvm-id`,
its own quote binding, its own audit actor and traffic attribution; revoking one is destroying
its record). Dev CVMs route to the pool's first Security CVM (`replica_index` 0, `replica_of`
NULL); every replica serves the attachments, secrets and bundle of that pool, because the load
balancer may hand a Dev CVM to any of them.

The team stack cannot reach the Console, so an admin registers replica i of team T
(`umbra cvm security-replica I`): the record is found or created and a fresh one-time
enrollment token minted; the operator puts the CVM id in the stack config and the token in
Pulumi secret config, and the booted replica enrolls with it. Registering again (a replica
that booted after its token expired, or a relaunched VM) mints a new token for the same record.
"""

from __future__ import annotations

import secrets
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console import audit, enrollment
from umbra.console.enums import AuditAction, CvmKind, CvmState
from umbra.console.models import Cvm

# The provider recorded for CVMs a team stack runs: the Console performs no side effect for
# them (starting, stopping and replacing them is `pulumi up`'s job).
TEAM_STACK_PROVIDER = "team-stack"
MAX_REPLICAS = 8  # components/config.py SecurityCvmConfig.replicas


class PoolError(Exception):
    """The pool cannot take this registration; the message says why."""


def pool_id(cvm: Cvm) -> str:
    """The Security CVM id Dev CVMs route to for the pool `cvm` (a Security CVM) serves."""
    return cvm.replica_of or cvm.id


def pool_lock(team: str) -> str:
    return f"security-pool:{team}"


def live_replicas(session: Session, primary_id: str) -> list[Cvm]:
    """The live replicas of a pool's first Security CVM, itself excluded."""
    return list(
        session.execute(
            select(Cvm).where(
                col(Cvm.replica_of) == primary_id, col(Cvm.state) != CvmState.destroyed
            )
        ).scalars()
    )


def _find(session: Session, team: str, index: int, primary: str | None) -> Cvm | None:
    query = select(Cvm).where(
        col(Cvm.team) == team,
        col(Cvm.kind) == CvmKind.security,
        col(Cvm.replica_index) == index,
        col(Cvm.state) != CvmState.destroyed,
    )
    query = query.where(
        col(Cvm.replica_of).is_(None) if primary is None else col(Cvm.replica_of) == primary
    )
    return session.execute(query.order_by(col(Cvm.created_at))).scalars().first()


def _name(session: Session, team: str, owner: str, index: int) -> str:
    """`security-I`, or with a suffix when this owner's destroyed record keeps that name."""
    name = f"security-{index}"
    taken = session.execute(
        select(col(Cvm.id)).where(
            col(Cvm.team) == team, col(Cvm.owner) == owner, col(Cvm.name) == name
        )
    ).first()
    return name if taken is None else f"{name}-{secrets.token_hex(3)}"


def _create(session: Session, team: str, index: int, primary: str | None, actor: str) -> Cvm:
    cvm = Cvm(
        id="cvm_" + secrets.token_hex(8),
        team=team,
        name=_name(session, team, actor, index),
        kind=CvmKind.security,
        owner=actor,
        provider=TEAM_STACK_PROVIDER,
        state=CvmState.pending,  # until it enrolls (`running`); `failed` if that is refused
        replica_of=primary,
        replica_index=index,
        created_by=actor,
    )
    session.add(cvm)
    session.flush()
    audit.append(
        session, actor=actor, team=team, action=AuditAction.cvm_register_replica, target=cvm.id,
        details={"replica": index, "pool": primary or cvm.id, "provider": TEAM_STACK_PROVIDER},
    )  # fmt: skip
    return cvm


def register(
    session: Session, team: str, index: int, actor: str
) -> tuple[Cvm, str, datetime, bool]:
    """Find or create replica `index` of the team's pool (the pool's first Security CVM too, if
    missing) and mint its one-time token. Returns (cvm, token, expiry, created). Call holding
    `pool_lock(team)`: concurrent registrations of one replica then make one record."""
    if not 0 <= index < MAX_REPLICAS:
        raise PoolError(f"replica: {index} is not in 0..{MAX_REPLICAS - 1}")
    created = False
    primary = _find(session, team, 0, None)
    if primary is None:
        primary, created = _create(session, team, 0, None, actor), index == 0
    cvm = primary
    if index > 0:
        found = _find(session, team, index, primary.id)
        cvm = found or _create(session, team, index, primary.id, actor)
        created = found is None
    token, expires = enrollment.issue_token(session, cvm, actor)
    return cvm, token, expires, created
