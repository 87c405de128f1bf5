"""Traffic retention: records older than `TRAFFIC_RETENTION_DAYS` are removed, never before every
configured SIEM sink has taken them.

The **cutoff** is the start of the UTC day `days` before now: records with `time` before it have
expired (so at least `days` full days are kept). PostgreSQL drops each day partition that ended
at or before the cutoff as a whole (DROP TABLE: no row-by-row delete, no dead tuples, no vacuum);
rows of the default partition, and every row on SQLite, are deleted in batches of `BATCH`, each
its own transaction (short locks; the overview's rollups are decremented in the same
transaction, traffic_rollup.subtract; a dropped day's slots are deleted with it).

**Fail closed with SIEM export.** When a sink is configured, a record may go only once every
configured sink's traffic cursor is at or past it (`export_seq`; SQLite `rowid`): a day partition
holding any record above the lowest cursor stays whole, and batched deletes stop at that cursor.
What is kept is counted (`waiting_for_export`), logged as a warning and written in the run's audit
entry. A partition is checked and dropped under an ACCESS EXCLUSIVE lock on the traffic table
(with a lock timeout: a busy table is retried next round), so no ingest can be adding to it.

**Not touched:** the audit log (`audit_entry`) is never dropped by retention (its hash chain is
the record of what was done, retention runs included), nor quarantined records.

SQLite: the row with the highest `rowid` is always kept: SQLite gives a new row `max(rowid) + 1`,
so deleting the newest row would let the next insert reuse a rowid at or below an export cursor,
and the exporter would skip it.

Every run appends one `traffic.retention` audit entry (actor `umbra-console`, team `-`: the
setting and the partitions are the deployment's, not one team's).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError
from sqlmodel import Session

from umbra.console import audit, traffic_partitions, traffic_rollup
from umbra.console.config import Settings
from umbra.console.enums import AuditAction
from umbra.console.export.mapping import Stream
from umbra.console.export.runner import cursor_position
from umbra.console.export.sinks import configured
from umbra.console.state import lock_key

log = logging.getLogger(__name__)
BATCH = 10_000
DROP_LOCK_TIMEOUT = "3s"
ACTOR = "umbra-console"
DEPLOYMENT = "-"


@dataclass(frozen=True)
class RetentionRun:
    days: int
    cutoff: datetime
    partitions_dropped: list[str] = field(default_factory=list)
    records_deleted: int = 0
    waiting_for_export: int = 0  # expired records kept until every configured sink has them
    export_positions: dict[str, int] = field(default_factory=dict)  # configured sink -> cursor
    busy: list[str] = field(default_factory=list)  # partitions whose lock did not come in time
    seconds: float = 0.0

    def details(self) -> dict[str, Any]:
        values = asdict(self)
        values["cutoff"] = self.cutoff.isoformat()
        del values["seconds"]
        values["milliseconds"] = round(self.seconds * 1000)  # canonical JSON has no floats
        return values


def cutoff_for(now: datetime, days: int) -> datetime:
    day = (now.astimezone(UTC) - timedelta(days=days)).date()
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def export_limit(engine: Engine, sinks: Sequence[str]) -> tuple[int | None, dict[str, int]]:
    """The highest export position every configured sink has taken (None: no sink configured,
    nothing to wait for), and each sink's position."""
    positions = {sink: cursor_position(engine, sink, Stream.TRAFFIC) for sink in sorted(sinks)}
    return (min(positions.values()) if positions else None), positions


def run(
    engine: Engine,
    *,
    days: int,
    sinks: Sequence[str] = (),
    now: datetime | None = None,
    batch: int = BATCH,
    write_gate: AbstractContextManager[Any] | None = None,
) -> RetentionRun | None:
    """One retention pass and its audit entry; None when another process is running one
    (PostgreSQL: a session advisory lock, so replicas and workers never run two at once)."""
    started = time.monotonic()
    gate = write_gate if write_gate is not None else contextlib.nullcontext()
    cutoff = cutoff_for(now or datetime.now(UTC), days)
    limit, positions = export_limit(engine, sinks)
    postgres = engine.dialect.name == "postgresql"
    with _leader(engine) as leading:
        if not leading:
            return None
        if postgres:
            dropped, busy, deleted, waiting = _run_postgresql(engine, cutoff, limit, batch)
        else:
            dropped, busy = [], []
            deleted, waiting = _run_sqlite(engine, cutoff, limit, batch, gate)
        outcome = RetentionRun(
            days=days,
            cutoff=cutoff,
            partitions_dropped=dropped,
            records_deleted=deleted,
            waiting_for_export=waiting,
            export_positions=positions,
            busy=busy,
            seconds=time.monotonic() - started,
        )
        with gate, Session(engine) as session, session.begin():
            audit.append(
                session,
                actor=ACTOR,
                team=DEPLOYMENT,
                action=AuditAction.traffic_retention,
                target="traffic_record",
                details=outcome.details(),
            )
    if waiting:
        log.warning(
            "traffic retention: %d expired records are kept until SIEM export has them "
            "(traffic cursors %s)",
            waiting,
            ", ".join(f"{s}={p}" for s, p in positions.items()),
        )
    if busy:
        log.warning("traffic retention: %s busy; retried next round", ", ".join(busy))
    log.info(
        "traffic retention: before %s, %d partitions dropped, %d records deleted",
        cutoff.isoformat(),
        len(dropped),
        deleted,
    )
    return outcome


def maintain(
    engine: Engine,
    settings: Settings,
    *,
    write_gate: AbstractContextManager[Any] | None = None,
    now: datetime | None = None,
) -> RetentionRun | None:
    """One maintenance round (the Console's periodic task and `umbra console retention`): the
    partitions of today and the days ahead (PostgreSQL), then retention when it is set."""
    when = now or datetime.now(UTC)
    made = traffic_partitions.ensure(engine, when)
    if made:
        log.info("traffic partitions made: %s", made)
    if settings.traffic_retention_days is None:
        return None
    sinks = configured(settings.export_otlp_url, settings.export_syslog_url)
    return run(
        engine,
        days=settings.traffic_retention_days,
        sinks=sinks,
        now=when,
        write_gate=write_gate,
    )


@contextlib.contextmanager
def _leader(engine: Engine) -> Any:
    if engine.dialect.name != "postgresql":
        yield True
        return
    key = lock_key("traffic:retention")
    with engine.connect() as guard:
        held = bool(guard.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar())
        guard.commit()
        try:
            yield held
        finally:
            if held:
                guard.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                guard.commit()


def _run_postgresql(
    engine: Engine, cutoff: datetime, limit: int | None, batch: int
) -> tuple[list[str], list[str], int, int]:
    dropped: list[str] = []
    busy: list[str] = []
    waiting = 0
    with engine.connect() as connection:
        partitioned = traffic_partitions.is_partitioned(connection)
        expired = [p for p in traffic_partitions.partitions(connection) if p.end <= cutoff]
    for part in expired:
        try:
            kept = _drop_partition(engine, part, limit)
        except OperationalError as exc:
            if "lock timeout" not in str(exc.orig):
                raise
            busy.append(part.name)
            continue
        if kept:
            waiting += kept
        else:
            dropped.append(part.name)
    table = traffic_partitions.DEFAULT if partitioned else traffic_partitions.PARENT
    deleted, kept = _delete_in_batches(engine, table, cutoff, limit, batch)
    return dropped, busy, deleted, waiting + kept


def _drop_partition(engine: Engine, part: traffic_partitions.Partition, limit: int | None) -> int:
    """Drop one expired day unless a configured sink has not taken all of it; returns how many of
    its records are kept for export (0: dropped)."""
    with engine.begin() as connection:
        connection.execute(text(f"SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT}'"))
        # The parent first (DROP needs it anyway): no ingest is mid-insert into this day, and no
        # lock order against an ingest waiting for the partition.
        connection.execute(text(f"LOCK TABLE {traffic_partitions.PARENT} IN ACCESS EXCLUSIVE MODE"))
        if limit is not None:
            kept = int(
                connection.execute(
                    text(
                        f"SELECT count(*) FROM {part.name} "  # noqa: S608 (a partition's name)
                        "WHERE export_seq IS NULL OR export_seq > :limit"
                    ),
                    {"limit": limit},
                ).scalar_one()
            )
            if kept:
                return kept
        connection.execute(text(f"DROP TABLE {part.name}"))
        bounds = {"a": int(part.start.timestamp()), "b": int(part.end.timestamp())}
        for rollup in ("traffic_slot", "traffic_slot_denial"):
            connection.execute(
                text(f"DELETE FROM {rollup} WHERE slot >= :a AND slot < :b"),  # noqa: S608
                bounds,
            )
    return 0


def _delete_in_batches(
    engine: Engine, table: str, cutoff: datetime, limit: int | None, batch: int
) -> tuple[int, int]:
    """PostgreSQL rows outside any day partition (or an unpartitioned table): (deleted, kept)."""
    exported = "" if limit is None else " AND export_seq <= :limit"
    statement = text(
        f"DELETE FROM {table} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {table} "  # noqa: S608
        f"WHERE time < :cutoff{exported} LIMIT :batch)) RETURNING "
        + traffic_rollup.DELETED_COLUMNS.format(slot=traffic_rollup.PG_SLOT_OF_TIME)
    )
    params: dict[str, Any] = {"cutoff": cutoff, "limit": limit, "batch": batch}
    deleted = 0
    while True:
        with engine.begin() as connection:
            rows = connection.execute(statement, params).all()
            traffic_rollup.subtract(connection, rows)
        deleted += len(rows)
        if len(rows) < batch:
            break
    kept = 0
    if limit is not None:
        with engine.connect() as connection:
            kept = _count(
                connection,
                table,
                "time < :cutoff AND (export_seq IS NULL OR export_seq > :limit)",
                params,
            )
    return deleted, kept


def _run_sqlite(
    engine: Engine,
    cutoff: datetime,
    limit: int | None,
    batch: int,
    gate: AbstractContextManager[Any],
) -> tuple[int, int]:
    with engine.connect() as connection:
        newest = connection.execute(text("SELECT max(rowid) FROM traffic_record")).scalar()
    if newest is None:
        return 0, 0
    bound = int(newest) - 1  # never the newest row (see the module's note on rowid reuse)
    kept = 0
    params: dict[str, Any] = {"cutoff": traffic_rollup.sqlite_time(cutoff), "batch": batch}
    if limit is not None:
        with engine.connect() as connection:
            kept = _count(
                connection,
                "traffic_record",
                "time < :cutoff AND rowid > :limit",
                {**params, "limit": limit},
            )
        bound = min(bound, limit)
    params["bound"] = bound
    statement = text(
        "DELETE FROM traffic_record WHERE rowid IN (SELECT rowid FROM traffic_record "  # noqa: S608
        "WHERE time < :cutoff AND rowid <= :bound LIMIT :batch) RETURNING "
        + traffic_rollup.DELETED_COLUMNS.format(slot=traffic_rollup.SQLITE_SLOT_OF_TIME)
    )
    deleted = 0
    while True:
        with gate, engine.begin() as connection:
            rows = connection.execute(statement, params).all()
            traffic_rollup.subtract(connection, rows)
        deleted += len(rows)
        if len(rows) < batch:
            break
    return deleted, kept


def _count(connection: Connection, table: str, where: str, params: dict[str, Any]) -> int:
    return int(
        connection.execute(
            text(f"SELECT count(*) FROM {table} WHERE {where}"),  # noqa: S608 (constants)
            params,
        ).scalar_one()
    )
