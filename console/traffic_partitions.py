"""PostgreSQL: the traffic table's daily partitions (revision 0015), made ahead by the Console.

`traffic_record` is range-partitioned on `time`, one partition per UTC day
(`traffic_record_pYYYYMMDD`), plus `traffic_record_default` for any time no day partition covers
(a record older than the oldest partition, or further ahead than the days made ahead): an insert
never fails for a missing partition. Days rather than weeks: retention is set in days and drops
whole partitions, so a day is as precise as the setting, and 400 days of partitions (its upper
bound) still plan quickly; a week would keep up to six expired days.

`ensure` makes the partitions of today and the next `AHEAD_DAYS` days; the Console calls it at
startup and every maintenance round (console/traffic_retention.py). A day that already has rows in
the default partition (the Console was down, or a clock ran ahead) gets them moved into its new
partition in the same transaction. The new table is made standalone and then ATTACHed, which
locks the parent only against other DDL (SHARE UPDATE EXCLUSIVE), not against ingest or queries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from sqlalchemy import Connection, text
from sqlalchemy.engine import Engine

from umbra.console.state import lock_key

PARENT = "traffic_record"
DEFAULT = "traffic_record_default"
AHEAD_DAYS = 2
DDL_LOCK_TIMEOUT = "5s"
_NAME = re.compile(r"^traffic_record_p(\d{8})$")


@dataclass(frozen=True)
class Partition:
    name: str
    day: date

    @property
    def start(self) -> datetime:
        return datetime(self.day.year, self.day.month, self.day.day, tzinfo=UTC)

    @property
    def end(self) -> datetime:
        return self.start + timedelta(days=1)


def name_of(day: date) -> str:
    return f"{PARENT}_p{day:%Y%m%d}"


def is_partitioned(connection: Connection) -> bool:
    kind = connection.execute(
        text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:t)"), {"t": PARENT}
    ).scalar()
    return kind == "p"


def partitions(connection: Connection) -> list[Partition]:
    """The day partitions, oldest first (the default partition is not among them)."""
    names = connection.execute(
        text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(:t)"
        ),
        {"t": PARENT},
    ).scalars()
    found = []
    for name in names:
        match = _NAME.match(name)
        if match:
            found.append(Partition(name, datetime.strptime(match[1], "%Y%m%d").date()))
    return sorted(found, key=lambda p: p.day)


def _create(connection: Connection, day: date) -> int:
    """Make one day's partition; returns how many rows moved into it from the default."""
    part = Partition(name_of(day), day)
    start, end = part.start.isoformat(), part.end.isoformat()  # constants from a date, no input
    connection.execute(text(f"CREATE TABLE {part.name} (LIKE {PARENT} INCLUDING DEFAULTS)"))
    moved = connection.execute(
        text(
            f"WITH d AS (DELETE FROM {DEFAULT} WHERE time >= :a AND time < :b RETURNING *) "  # noqa: S608
            f"INSERT INTO {part.name} SELECT * FROM d"
        ),
        {"a": part.start, "b": part.end},
    ).rowcount
    connection.execute(
        text(
            f"ALTER TABLE {PARENT} ATTACH PARTITION {part.name} "
            f"FOR VALUES FROM ('{start}') TO ('{end}')"
        )
    )
    return int(moved or 0)


def ensure(engine: Engine, now: datetime, ahead: int = AHEAD_DAYS) -> dict[str, int]:
    """Make the missing partitions of `now`'s UTC day and the `ahead` days after it; returns each
    made partition's name with the rows moved into it from the default partition. Replicas
    serialize on an advisory lock; no-op on SQLite or an unpartitioned table."""
    if engine.dialect.name != "postgresql":
        return {}
    made: dict[str, int] = {}
    today = now.astimezone(UTC).date()
    with engine.begin() as connection:
        if not is_partitioned(connection):
            return {}
        connection.execute(text(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'"))
        connection.execute(
            text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock_key("traffic:partitions")}
        )
        existing = {p.day for p in partitions(connection)}
        for offset in range(ahead + 1):
            day = today + timedelta(days=offset)
            if day not in existing:
                made[name_of(day)] = _create(connection, day)
    return made
