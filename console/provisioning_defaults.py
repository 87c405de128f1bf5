"""What a CVM gets by default at launch, for every provider.

A Dev CVM launched without `security_cvm_id` is routed to its team's Security CVM when the team
has exactly one live one (with several, the caller must choose; with none, it stays unrouted and
its forwarder refuses everything, which is fail-closed). Replicas of a pool (console/security_pool.py)
are not routing targets: a pool counts once, by its first Security CVM.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console.enums import CvmKind, CvmState
from umbra.console.models import Cvm


def default_security_cvm(session: Session, team: str) -> str | None:
    rows = session.execute(
        select(col(Cvm.id)).where(
            col(Cvm.team) == team,
            col(Cvm.kind) == CvmKind.security,
            col(Cvm.state) != CvmState.destroyed,
            col(Cvm.replica_of).is_(None),
        )
    ).all()
    return str(rows[0][0]) if len(rows) == 1 else None
