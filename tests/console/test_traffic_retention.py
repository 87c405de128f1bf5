"""Traffic partitions (PostgreSQL) and retention (both backends): expired records go, by whole
day partitions on PostgreSQL and in batches on SQLite, never before every configured SIEM sink
has them; the rollups keep matching the records; each run is audited; the audit log stays."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select
from typer.testing import CliRunner

from tests.console.conftest import new_database
from tests.console.helpers import start_server
from tests.console.oidc_issuer import LocalIssuer
from tests.console.siem_receivers import OtlpReceiver, make_pki
from umbra.cli.app import app as umbra_app
from umbra.console import (
    db,
    traffic_partitions,
    traffic_retention,
    traffic_rollup,
    traffic_store,
)
from umbra.console.config import ConfigError, settings_from_env
from umbra.console.enums import AuditAction
from umbra.console.export import runner
from umbra.console.export.mapping import Stream
from umbra.console.export.sinks import OtlpSink, SinkName
from umbra.console.models import AuditEntry, ExportCursor
from umbra.console.models import TrafficRecord as Row
from umbra.contracts.traffic import TrafficRecord
from umbra.policy.bundle import generate_key

NOW = datetime.now(UTC)


def _records(team: str, count: int, start: datetime, step: timedelta) -> list[TrafficRecord]:
    return [
        TrafficRecord(
            team=team,
            time=start + i * step,
            owner=f"dev{i % 3}@example.com",
            method="GET",
            host=f"h{i % 4}.example.com",
            path="/v1",
            decision="deny" if i % 5 == 0 else "allow",
            reason="host_not_allowed" if i % 5 == 0 else None,
            rule_id=f"r{i % 2}" if i % 5 == 0 else None,
        )
        for i in range(count)
    ]


def _ingest(engine: Engine, records: list[TrafficRecord]) -> int:
    with Session(engine) as session, session.begin():
        return traffic_store.insert_records(session, records, "scvm-1", datetime.now(UTC))


def _ingest_at_0013(engine: Engine, records: list[TrafficRecord]) -> None:
    """The ingest statement as it was before 0015 (the key was (team, id))."""
    old = traffic_store._PG_INSERT.replace("(team, id, time) DO", "(team, id) DO")
    document = traffic_store.RECORDS.dump_json(records).decode()
    with Session(engine) as session, session.begin():
        dbapi = session.connection().connection.driver_connection
        with dbapi.cursor() as cursor:
            cursor.execute(
                traffic_rollup.pg_insert_with_rollups(old),
                {"scvm": "scvm-1", "now": datetime.now(UTC), "doc": document},
            )


def _ids(engine: Engine) -> set[str]:
    with Session(engine) as session:
        return {str(i) for i in session.exec(select(Row.id)).all()}


def _position(engine: Engine, record_id: str) -> int:
    """The export position of a record (PostgreSQL export_seq, SQLite rowid)."""
    column = "export_seq" if engine.dialect.name == "postgresql" else "rowid"
    with engine.connect() as connection:
        return int(
            connection.execute(
                sqlalchemy.text(f"SELECT {column} FROM traffic_record WHERE id = :i"),  # noqa: S608
                {"i": record_id},
            ).scalar_one()
        )


def _set_cursor(engine: Engine, sink: str, position: int) -> None:
    with Session(engine) as session, session.begin():
        row = session.get(ExportCursor, (sink, Stream.TRAFFIC.value))
        if row is None:
            session.add(ExportCursor(sink=sink, stream=Stream.TRAFFIC.value, position=position))
        else:
            row.position = position


def _rollups_match(engine: Engine) -> None:
    """The overview's slots equal a recount of the stored records (per team, owner, CVM, slot)."""
    slot = (
        "(floor(extract(epoch FROM time) / 1800) * 1800)::bigint"
        if engine.dialect.name == "postgresql"
        else "(CAST(strftime('%s', time) AS INTEGER) / 1800 * 1800)"
    )
    with engine.connect() as connection:
        counted = connection.execute(
            sqlalchemy.text(
                f"SELECT team, coalesce(owner, ''), coalesce(cvm_id, ''), {slot}, count(*), "  # noqa: S608
                "sum(CASE WHEN decision = 'deny' THEN 1 ELSE 0 END) FROM traffic_record "
                "GROUP BY 1, 2, 3, 4"
            )
        ).all()
        slots = connection.execute(
            sqlalchemy.text("SELECT team, owner, cvm_id, slot, total, denied FROM traffic_slot")
        ).all()
        denials = connection.execute(
            sqlalchemy.text("SELECT sum(count) FROM traffic_slot_denial WHERE dimension = 'host'")
        ).scalar()

    def norm(row: sqlalchemy.Row[tuple[object, ...]]) -> tuple[object, ...]:
        return (str(row[0]), str(row[1]), str(row[2]), *(int(str(v)) for v in row[3:]))

    assert sorted(map(norm, slots)) == sorted(map(norm, counted))
    assert int(denials or 0) == sum(int(r[5]) for r in counted)


def _retention_entries(engine: Engine) -> list[AuditEntry]:
    with Session(engine) as session:
        return list(
            session.exec(
                select(AuditEntry).where(col(AuditEntry.action) == AuditAction.traffic_retention)
            ).all()
        )


def test_retention_setting_is_strict() -> None:
    assert (
        settings_from_env({"UMBRA_CONSOLE_TRAFFIC_RETENTION_DAYS": "30"}).traffic_retention_days
        == 30
    )
    assert settings_from_env({}).traffic_retention_days is None
    for bad in ("0", "401", "30d", "1.5", "", "-3", "true"):
        with pytest.raises(ConfigError, match=r"^UMBRA_CONSOLE_TRAFFIC_RETENTION_DAYS: "):
            settings_from_env({"UMBRA_CONSOLE_TRAFFIC_RETENTION_DAYS": bad})


def test_expired_records_go_and_the_rest_stay(engine: Engine) -> None:
    team = "t" + uuid.uuid4().hex[:8]
    traffic_partitions.ensure(engine, NOW - timedelta(days=12), ahead=14)
    old = _records(team, 40, NOW - timedelta(days=11), timedelta(hours=1))  # 11 .. 9.4 days ago
    fresh = _records(team, 40, NOW - timedelta(days=2), timedelta(hours=1))
    _ingest(engine, old + fresh)
    run = traffic_retention.run(engine, days=7, now=NOW)
    assert run is not None
    cutoff = traffic_retention.cutoff_for(NOW, 7)
    expired = {str(r.id) for r in old + fresh if r.time < cutoff}
    assert expired == {str(r.id) for r in old}
    assert _ids(engine) == {str(r.id) for r in fresh}
    if engine.dialect.name == "postgresql":
        assert run.partitions_dropped  # whole days, no row-by-row delete
        assert run.records_deleted == 0
        with engine.connect() as connection:
            days = [p.day for p in traffic_partitions.partitions(connection)]
        assert min(days) == cutoff.date()
    else:
        assert run.records_deleted == len(old)
    assert run.waiting_for_export == 0
    _rollups_match(engine)
    # one audit entry per run, in the chain (the audit log itself is never removed)
    traffic_retention.run(engine, days=7, now=NOW)
    entries = _retention_entries(engine)
    assert len(entries) == 2
    assert entries[0].actor == "umbra-console"
    assert entries[0].details["cutoff"] == cutoff.isoformat()


def test_retention_waits_for_every_configured_sink(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    team = "t" + uuid.uuid4().hex[:8]
    traffic_partitions.ensure(engine, NOW - timedelta(days=12), ahead=14)
    days = [_records(team, 10, NOW - timedelta(days=d), timedelta(minutes=7)) for d in (11, 10, 9)]
    for day in days:
        _ingest(engine, day)
    fresh = _records(team, 5, NOW - timedelta(hours=3), timedelta(minutes=1))
    _ingest(engine, fresh)
    sinks = [SinkName.OTLP, SinkName.SYSLOG]
    # nothing exported yet: nothing goes, and the log and the audit entry say why
    with caplog.at_level(logging.WARNING, logger="umbra.console.traffic_retention"):
        run = traffic_retention.run(engine, days=7, sinks=sinks, now=NOW)
    assert run is not None
    assert run.waiting_for_export == 30 and run.records_deleted == 0
    assert _ids(engine) == {str(r.id) for r in days[0] + days[1] + days[2] + fresh}
    assert "30 expired records are kept until SIEM export has them" in caplog.text
    assert _retention_entries(engine)[-1].details["waiting_for_export"] == 30
    # otlp has taken the first day and a half, syslog only the first day: the first day goes
    _set_cursor(engine, SinkName.OTLP, _position(engine, str(days[1][4].id)))
    _set_cursor(engine, SinkName.SYSLOG, _position(engine, str(days[0][-1].id)))
    run = traffic_retention.run(engine, days=7, sinks=sinks, now=NOW)
    assert run is not None
    assert _ids(engine) == {str(r.id) for r in days[1] + days[2] + fresh}
    assert run.waiting_for_export == 20
    # a sink no longer configured does not hold retention back
    _set_cursor(engine, SinkName.OTLP, _position(engine, str(days[2][-1].id)))
    run = traffic_retention.run(engine, days=7, sinks=[SinkName.OTLP], now=NOW)
    assert run is not None and run.waiting_for_export == 0
    assert _ids(engine) == {str(r.id) for r in fresh}
    _rollups_match(engine)


def test_sqlite_keeps_the_newest_row_so_no_rowid_is_reused(request: pytest.FixtureRequest) -> None:
    """Deleting the newest row would hand its rowid to the next insert, at or below the export
    cursor: the exporter would skip that record (this test fails without the guard)."""
    url, _ = new_database("sqlite", request)
    db.upgrade(url)
    engine = db.make_engine(url)
    team = "t" + uuid.uuid4().hex[:8]
    old = _records(team, 5, NOW - timedelta(days=20), timedelta(minutes=1))
    _ingest(engine, old)
    _set_cursor(engine, SinkName.OTLP, _position(engine, str(old[-1].id)))  # all exported
    traffic_retention.run(engine, days=7, sinks=[SinkName.OTLP], now=NOW)
    assert _ids(engine) == {str(old[-1].id)}
    new = _records(team, 1, NOW, timedelta(0))
    _ingest(engine, new)
    batch = runner._traffic_batch(
        engine, runner.cursor_position(engine, "otlp", Stream.TRAFFIC), 10
    )
    assert [event["metadata.uid"] for _, event in batch] == [str(new[0].id)]
    engine.dispose()


def test_partitions_are_made_ahead_and_catch_rows_from_the_default(
    request: pytest.FixtureRequest,
) -> None:
    url, _ = new_database("postgresql", request)
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        with engine.connect() as connection:
            days = {p.day for p in traffic_partitions.partitions(connection)}
        today = NOW.date()
        assert {today + timedelta(days=d) for d in range(3)} <= days
        # a record no partition covers (a clock 10 days ahead) is stored, in the default
        team = "t" + uuid.uuid4().hex[:8]
        ahead = _records(team, 3, NOW + timedelta(days=10), timedelta(minutes=1))
        assert _ingest(engine, ahead) == 3
        seqs = {str(r.id): _position(engine, str(r.id)) for r in ahead}
        with engine.connect() as connection:
            in_default = connection.execute(
                sqlalchemy.text(f"SELECT count(*) FROM {traffic_partitions.DEFAULT}")  # noqa: S608
            ).scalar_one()
        assert in_default == 3
        made = traffic_partitions.ensure(engine, NOW + timedelta(days=10))
        assert made[traffic_partitions.name_of((NOW + timedelta(days=10)).date())] == 3
        with engine.connect() as connection:
            left = connection.execute(
                sqlalchemy.text(f"SELECT count(*) FROM {traffic_partitions.DEFAULT}")  # noqa: S608
            ).scalar_one()
        assert left == 0
        assert {i: _position(engine, i) for i in seqs} == seqs  # the export order is kept
        assert traffic_partitions.ensure(engine, NOW + timedelta(days=10)) == {}  # idempotent
        _rollups_match(engine)
    finally:
        engine.dispose()


def test_migration_partitions_a_table_with_rows(request: pytest.FixtureRequest) -> None:
    """0013 -> 0015 on PostgreSQL with records in it: every row (and its export_seq) is kept, the
    rollups still match, and an exporter resumes from its cursor without loss or repeat."""
    url, _ = new_database("postgresql", request)
    db.upgrade(url, "0013")
    engine = db.make_engine(url)
    pki = make_pki(Path(request.getfixturevalue("tmp_path")))
    otlp = OtlpReceiver(pki)
    otlp.start()
    try:
        team = "t" + uuid.uuid4().hex[:8]
        records = (
            _records(team, 300, NOW - timedelta(days=5), timedelta(minutes=29))
            + _records(team, 2, NOW - timedelta(days=500), timedelta(minutes=1))  # beyond 400 days
        )
        for start in range(0, len(records), 50):
            _ingest_at_0013(engine, records[start : start + 50])
        with engine.connect() as connection:
            before = set(
                connection.execute(
                    sqlalchemy.text("SELECT team, id, time, export_seq FROM traffic_record")
                ).all()
            )
            slots = set(connection.execute(sqlalchemy.text("SELECT * FROM traffic_slot")).all())
        sink = OtlpSink(otlp.url, pki.ca)
        assert runner.export_round(engine, sink, Stream.TRAFFIC, 100) == 100  # one batch before
        sink.close()
        sent_before = {e["metadata.uid"] for e in otlp.events()}
        db.upgrade(url)
        with engine.connect() as connection:
            after = set(
                connection.execute(
                    sqlalchemy.text("SELECT team, id, time, export_seq FROM traffic_record")
                ).all()
            )
            assert traffic_partitions.is_partitioned(connection)
            parts = traffic_partitions.partitions(connection)
            slots_after = set(
                connection.execute(sqlalchemy.text("SELECT * FROM traffic_slot")).all()
            )
            old = connection.execute(
                sqlalchemy.text(f"SELECT count(*) FROM {traffic_partitions.DEFAULT}")  # noqa: S608
            ).scalar_one()
        assert after == before and len(after) == len(records)
        assert slots_after == slots
        assert old == 2
        assert parts[0].day == (NOW - timedelta(days=5)).date()
        assert parts[-1].day == NOW.date() + timedelta(days=2)
        _rollups_match(engine)
        # ingest goes on after the migration, numbered after every old record
        newer = _records(team, 20, NOW, timedelta(seconds=1))
        _ingest(engine, newer)
        assert min(_position(engine, str(r.id)) for r in newer) > max(r[3] for r in before)
        exporter = runner.Exporter(engine, [OtlpSink(otlp.url, pki.ca)], interval=0.5, batch=100)
        while exporter.step(0.0):
            pass
        exporter.close()
        got = Counter(
            e["metadata.uid"] for e in otlp.events() if e["metadata.log_name"] == "traffic"
        )
        assert set(got) == {str(r.id) for r in records + newer}
        assert {uid for uid, n in got.items() if n > 1} <= sent_before  # at most the 1st batch
    finally:
        otlp.stop()
        engine.dispose()


def test_retention_during_ingest_and_export_loses_and_repeats_nothing(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """PostgreSQL, 4 parallel ingest clients (records of expired days and of today), the exporter
    and retention rounds running at once: every record reaches the receiver exactly once, and
    what retention removed had been exported first."""
    url, _ = new_database("postgresql", request)
    db.upgrade(url)
    engine = db.make_engine(url)
    traffic_partitions.ensure(engine, NOW - timedelta(days=12), ahead=14)
    pki = make_pki(tmp_path)
    otlp = OtlpReceiver(pki)
    otlp.start()
    exporter = runner.Exporter(engine, [OtlpSink(otlp.url, pki.ca)], interval=0.1, batch=200)
    team = "t" + uuid.uuid4().hex[:8]
    batches = [
        _records(team, 100, NOW - timedelta(days=11 - (i % 11), minutes=i), timedelta(seconds=7))
        for i in range(48)
    ]
    done = threading.Event()
    runs: list[traffic_retention.RetentionRun] = []

    def export() -> None:
        while not done.is_set():
            exporter.step(time.monotonic())

    def retain() -> None:
        while not done.is_set():
            run = traffic_retention.run(engine, days=7, sinks=[SinkName.OTLP], now=NOW)
            if run is not None:
                runs.append(run)

    workers = [threading.Thread(target=export), threading.Thread(target=retain)]
    try:
        for worker in workers:
            worker.start()
        with ThreadPoolExecutor(4) as pool:
            assert sum(pool.map(lambda b: _ingest(engine, b), batches)) == 4800
    finally:
        done.set()
        for worker in workers:
            worker.join()
    exporter.close()
    exporter = runner.Exporter(engine, [OtlpSink(otlp.url, pki.ca)], interval=0.1, batch=200)
    while exporter.step(0.0):  # a fresh exporter (a restart) drains what is left
        pass
    exporter.close()
    final = traffic_retention.run(engine, days=7, sinks=[SinkName.OTLP], now=NOW)
    otlp.stop()
    try:
        got = Counter(
            e["metadata.uid"] for e in otlp.events() if e["metadata.log_name"] == "traffic"
        )
        expected = {str(r.id) for batch in batches for r in batch}
        assert set(got) == expected and max(got.values()) == 1
        cutoff = traffic_retention.cutoff_for(NOW, 7)
        kept = {str(r.id) for batch in batches for r in batch if r.time >= cutoff}
        assert _ids(engine) == kept  # everything expired went once exported
        assert final is not None and final.waiting_for_export == 0
        assert any(run.partitions_dropped for run in [*runs, final])
        _rollups_match(engine)
    finally:
        engine.dispose()


def test_cli_runs_one_round_and_says_what_waits(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = new_database("sqlite", request)
    db.upgrade(url)
    engine = db.make_engine(url)
    team = "t" + uuid.uuid4().hex[:8]
    old = _records(team, 6, datetime.now(UTC) - timedelta(days=20), timedelta(minutes=1))
    _ingest(engine, old)
    _set_cursor(engine, SinkName.SYSLOG, _position(engine, str(old[2].id)))
    engine.dispose()
    invoke = ["console", "retention", "--database-url", url]
    monkeypatch.delenv("UMBRA_CONSOLE_TRAFFIC_RETENTION_DAYS", raising=False)
    result = CliRunner().invoke(umbra_app, invoke)
    assert result.exit_code == 2
    assert "UMBRA_CONSOLE_TRAFFIC_RETENTION_DAYS is not set" in result.output
    monkeypatch.setenv("UMBRA_CONSOLE_TRAFFIC_RETENTION_DAYS", "7")
    monkeypatch.setenv("UMBRA_CONSOLE_EXPORT_SYSLOG_URL", "tls://127.0.0.1:6514")
    result = CliRunner().invoke(umbra_app, invoke)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "0 day partitions dropped, 3 records deleted" in said
    assert "3 expired records kept until SIEM export has them (traffic cursors syslog=3)" in said


def test_a_serving_console_makes_partitions_and_runs_retention(
    request: pytest.FixtureRequest, issuer: LocalIssuer, tmp_path: Path
) -> None:
    """The app's lifespan runs a maintenance round at startup (PostgreSQL): tomorrow's missing
    partition is made, an expired day is dropped, and the run is audited."""
    url, sqlite_path = new_database("postgresql", request)
    db.upgrade(url)
    engine = db.make_engine(url)
    tomorrow = traffic_partitions.name_of(datetime.now(UTC).date() + timedelta(days=1))
    with engine.begin() as connection:
        connection.execute(sqlalchemy.text(f"DROP TABLE {tomorrow}"))
    traffic_partitions.ensure(engine, datetime.now(UTC) - timedelta(days=20), ahead=0)
    old = _records(
        "t" + uuid.uuid4().hex[:8], 3, datetime.now(UTC) - timedelta(days=20), timedelta(minutes=1)
    )
    _ingest(engine, old)
    server = start_server(
        "postgresql", url, sqlite_path, issuer.url, generate_key(), tmp_path,
        traffic_retention_days=7,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not _retention_entries(engine):
            assert time.monotonic() < deadline, "no retention run at startup"
            time.sleep(0.1)
        with engine.connect() as connection:
            names = {p.name for p in traffic_partitions.partitions(connection)}
        assert tomorrow in names
        assert not _ids(engine)
    finally:
        server.stop()
        engine.dispose()
