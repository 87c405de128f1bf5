"""Export rounds and the background loop: read what follows a sink's cursor, send it, move the
cursor (at least once: a crash between send and move re-sends only that batch).

Traffic is ordered by `export_seq` (PostgreSQL sequence; SQLite `rowid`). A sequence value is
taken before its transaction commits, so a reader could see 7 before 6 commits; the exporter
therefore reads only up to a **horizon**: it takes, for an instant, the advisory lock every ingest
transaction holds shared (traffic_store.EXPORT_HORIZON_LOCK), so no insert is in flight, and
reads the sequence's last value: everything at or below it has committed or never will. Audit
entries are appended under one lock held to commit, so their `seq` is already commit-ordered."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session, col, select

from umbra.console.export import mapping
from umbra.console.export.mapping import Stream
from umbra.console.export.sinks import Sink, SinkError
from umbra.console.models import EXPORT_SEQUENCE, AuditEntry, ExportCursor, TrafficRecord
from umbra.console.state import lock_key
from umbra.console.traffic_store import EXPORT_HORIZON_LOCK

log = logging.getLogger(__name__)
MAX_BACKOFF_SECONDS = 60.0
HORIZON_LOCK_TIMEOUT = "5s"


def _postgres(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql"


def cursor_position(engine: Engine, sink: str, stream: Stream) -> int:
    with Session(engine) as session:
        row = session.get(ExportCursor, (sink, stream.value))
        return row.position if row else 0


def _save_position(engine: Engine, sink: str, stream: Stream, position: int) -> None:
    values: dict[str, Any] = {
        "sink": sink,
        "stream": stream.value,
        "position": position,
        "updated_at": datetime.now(UTC),
    }
    insert = pg_insert if _postgres(engine) else sqlite_insert
    statement = insert(ExportCursor).values(**values)
    statement = statement.on_conflict_do_update(
        index_elements=["sink", "stream"],
        set_={"position": statement.excluded.position, "updated_at": statement.excluded.updated_at},
        # never backwards: a stale exporter finishing late cannot rewind another's progress
        where=ExportCursor.__table__.c.position < statement.excluded.position,  # type: ignore[attr-defined]
    )
    with engine.begin() as connection:
        connection.execute(statement)


def traffic_horizon(engine: Engine) -> int:
    """The highest `export_seq` no in-flight ingest can still fall below (PostgreSQL)."""
    with engine.begin() as connection:
        connection.execute(text(f"SET LOCAL lock_timeout = '{HORIZON_LOCK_TIMEOUT}'"))
        connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": EXPORT_HORIZON_LOCK})
        last, called = connection.execute(
            text(f"SELECT last_value, is_called FROM {EXPORT_SEQUENCE}")  # noqa: S608 (constant)
        ).one()
    return int(last) if called else 0


def _traffic_batch(engine: Engine, after: int, limit: int) -> list[tuple[int, dict[str, Any]]]:
    with Session(engine) as session:
        if _postgres(engine):
            horizon = traffic_horizon(engine)
            seq = col(TrafficRecord.export_seq)
            rows = session.exec(
                select(TrafficRecord).where(seq > after, seq <= horizon).order_by(seq).limit(limit)
            ).all()
            return [(int(r.export_seq or 0), mapping.traffic_event(r)) for r in rows]
        # SQLite: writes are serial, so rowid order is commit order
        rowid = text("traffic_record.rowid")
        result = session.exec(
            select(TrafficRecord, rowid)
            .where(text("traffic_record.rowid > :after"))
            .order_by(rowid)
            .limit(limit)
            .params(after=after)
        ).all()
        return [(int(position), mapping.traffic_event(r)) for r, position in result]


def _audit_batch(engine: Engine, after: int, limit: int) -> list[tuple[int, dict[str, Any]]]:
    with Session(engine) as session:
        entries = session.exec(
            select(AuditEntry)
            .where(AuditEntry.seq > after)
            .order_by(col(AuditEntry.seq))
            .limit(limit)
        ).all()
        return [(e.seq, mapping.audit_event(e)) for e in entries]


def export_round(engine: Engine, sink: Sink, stream: Stream, limit: int) -> int:
    """Send one batch past the sink's cursor and move the cursor; return how many were sent.
    Raises `SinkError` (nothing moved) when the receiver did not take it."""
    after = cursor_position(engine, sink.name, stream)
    reader = _traffic_batch if stream is Stream.TRAFFIC else _audit_batch
    batch = reader(engine, after, limit)
    if not batch:
        return 0
    sink.send([event for _, event in batch])
    _save_position(engine, sink.name, stream, batch[-1][0])
    return len(batch)


@dataclass
class Exporter:
    """The Console's export task: each sink drained in turn, a failing one retried with jittered
    exponential backoff (interval x 2^failures, at most a minute) while the others go on."""

    engine: Engine
    sinks: Sequence[Sink]
    interval: float
    batch: int
    failures: dict[str, int] = field(default_factory=dict)
    next_try: dict[str, float] = field(default_factory=dict)
    attempts: list[tuple[str, float, bool]] = field(default_factory=list)  # (sink, time, ok)
    _guard: Connection | None = None

    def _leader(self) -> bool:
        """PostgreSQL: one exporter among the Console's workers and replicas (a session-level
        advisory lock on a connection held for that); the others stand by."""
        if not _postgres(self.engine):
            return True
        if self._guard is not None:
            try:
                self._guard.execute(text("SELECT 1"))
                return True
            except SQLAlchemyError:
                self._drop_guard()
        connection = self.engine.connect()
        held = connection.execute(
            text("SELECT pg_try_advisory_lock(:k)"), {"k": lock_key("export:leader")}
        ).scalar_one()
        connection.commit()
        if held:
            self._guard = connection
            return True
        connection.close()
        return False

    def _drop_guard(self) -> None:
        if self._guard is not None:
            try:
                self._guard.invalidate()  # the lock ends with the session, never back in the pool
            finally:
                self._guard = None

    def step(self, now: float) -> int:
        """One pass over every due sink and stream; returns how many events were sent."""
        try:
            if not self._leader():
                return 0
        except SQLAlchemyError as exc:
            log.warning("export: database unavailable (%s); retrying", type(exc).__name__)
            return 0
        sent = 0
        for sink in self.sinks:
            if now < self.next_try.get(sink.name, 0.0):
                continue
            try:
                for stream in Stream:
                    while (count := export_round(self.engine, sink, stream, self.batch)) > 0:
                        sent += count
                        if count < self.batch:
                            break
            except (SinkError, SQLAlchemyError) as exc:
                failures = self.failures.get(sink.name, 0) + 1
                self.failures[sink.name] = failures
                delay = min(MAX_BACKOFF_SECONDS, self.interval * 2**failures)
                self.next_try[sink.name] = now + delay * random.uniform(0.8, 1.0)  # noqa: S311
                self.attempts.append((sink.name, now, False))
                reason = str(exc) if isinstance(exc, SinkError) else type(exc).__name__
                log.warning("export to %s failed (%s); retry in %.1f s", sink.name, reason, delay)
                continue
            self.attempts.append((sink.name, now, True))
            self.failures[sink.name] = 0
            self.next_try[sink.name] = 0.0
        return sent

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await asyncio.to_thread(self.step, loop.time())
                await asyncio.sleep(self.interval)
        finally:
            self.close()

    def close(self) -> None:
        self._drop_guard()
        for sink in self.sinks:
            sink.close()
