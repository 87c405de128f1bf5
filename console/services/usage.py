"""LLM usage sums (`/teams/{team}/usage`, `umbra usage`, the web page): the traffic records that
carry usage (proxy.md, LLM usage), summed per UTC day, developer (owner), CVM and model. Admins
see the team, developers their own usage (the traffic rule)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from sqlalchemy import Table, func, select

from umbra.console.enums import Role
from umbra.console.models import TrafficRecord
from umbra.console.services.access import User, member
from umbra.console.services.errors import Forbidden, Invalid
from umbra.console.state import Console

TABLE: Table = TrafficRecord.__table__  # type: ignore[attr-defined]
DEFAULT_DAYS = 30
MAX_DAYS = 400
TOKENS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")


@dataclass(frozen=True)
class UsageRow:
    day: date
    owner: str | None
    cvm_id: str | None
    model: str
    requests: int
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int


@dataclass(frozen=True)
class UsageReport:
    since: datetime
    until: datetime
    rows: list[UsageRow]

    def total(self, name: str) -> int:
        return sum(int(getattr(row, name)) for row in self.rows)


def usage(
    *,
    console: Console,
    user: User,
    team: str,
    since: datetime | None = None,
    until: datetime | None = None,
    owner: str | None = None,
    cvm_id: str | None = None,
) -> UsageReport:
    if member(user, team) != Role.admin:
        if owner is not None and owner != user.subject:
            raise Forbidden("owner: developers see their own usage")
        owner = user.subject
    until = until or datetime.now(UTC)
    since = since or until - timedelta(days=DEFAULT_DAYS)
    if since >= until:
        raise Invalid("since must be before until")
    if until - since > timedelta(days=MAX_DAYS):
        raise Invalid(f"a usage report spans at most {MAX_DAYS} days")
    c = TABLE.c
    with console.session() as session:
        if session.get_bind().dialect.name == "postgresql":
            day = func.date(func.timezone("UTC", c.time))
        else:
            day = func.date(c.time)  # SQLite stores UTC text
        query = (
            select(
                day.label("day"),
                c.owner,
                c.cvm_id,
                c.llm_model,
                func.count().label("requests"),
                *(func.coalesce(func.sum(getattr(c, f"llm_{name}")), 0) for name in TOKENS),
            )
            .where(c.team == team, c.llm_model.is_not(None), c.time >= since, c.time < until)
            .group_by(day, c.owner, c.cvm_id, c.llm_model)
            .order_by(day, c.owner, c.cvm_id, c.llm_model)
        )
        if owner is not None:
            query = query.where(c.owner == owner)
        if cvm_id is not None:
            query = query.where(c.cvm_id == cvm_id)
        rows = session.execute(query).all()
    return UsageReport(
        since=since,
        until=until,
        rows=[
            UsageRow(
                day=row[0] if isinstance(row[0], date) else date.fromisoformat(str(row[0])),
                owner=row[1],
                cvm_id=row[2],
                model=row[3],
                requests=int(row[4]),
                input_tokens=int(row[5]),
                output_tokens=int(row[6]),
                cache_read_tokens=int(row[7]),
                cache_write_tokens=int(row[8]),
            )
            for row in rows
        ],
    )
