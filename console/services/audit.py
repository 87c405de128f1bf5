"""The audit log as the API pages it: a team's entries in chain order, for its admins (appends
happen inside the actions themselves, `console/audit.py`)."""

from __future__ import annotations

from sqlalchemy import select
from sqlmodel import col

from umbra.console.db import as_utc
from umbra.console.enums import Role
from umbra.console.models import AuditEntry
from umbra.console.schemas import AuditEntryOut, AuditPage
from umbra.console.services.access import User, require_role
from umbra.console.state import Console


def entries(*, console: Console, user: User, team: str, after: int, limit: int) -> AuditPage:
    """Up to `limit` entries after sequence number `after`, and the cursor of the next page."""
    require_role(user, team, Role.admin)
    with console.session() as session:
        rows = list(
            session.execute(
                select(AuditEntry)
                .where(col(AuditEntry.team) == team, col(AuditEntry.seq) > after)
                .order_by(col(AuditEntry.seq))
                .limit(limit + 1)
            ).scalars()
        )
    more = len(rows) > limit
    rows = rows[:limit]
    page = [
        AuditEntryOut.model_validate({**row.model_dump(), "time": as_utc(row.time)}) for row in rows
    ]
    return AuditPage(entries=page, next_cursor=rows[-1].seq if more else None)
