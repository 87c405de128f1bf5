"""SIEM export (console/export): traffic and audit reach a real rsyslog over TLS and an OTLP/HTTP
receiver validating every request against opentelemetry-proto, each entry once, across receiver
outages (backoff) and Console restarts (the cursor in the database)."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from tests.console.conftest import new_database
from tests.console.helpers import new_team, start_server
from tests.console.oidc_issuer import LocalIssuer
from tests.console.siem_receivers import OtlpReceiver, Pki, Rsyslog, make_pki
from umbra.console import audit, db, traffic_store
from umbra.console.enums import AuditAction
from umbra.console.export import runner
from umbra.console.export.mapping import Stream
from umbra.console.export.sinks import OtlpSink, Sink, SyslogSink
from umbra.contracts.traffic import TrafficRecord
from umbra.policy.bundle import generate_key


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@pytest.fixture
def rsyslog(tmp_path: Path, pki: Pki) -> Iterator[Rsyslog]:
    if not Path("/usr/lib/x86_64-linux-gnu/rsyslog/lmnsd_gtls.so").exists():
        pytest.fail("rsyslog-gnutls is not installed: run scripts/system-deps")
    receiver = Rsyslog(tmp_path, pki)
    receiver.start()
    yield receiver
    receiver.stop()


@pytest.fixture
def otlp(pki: Pki) -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver(pki)
    receiver.start()
    yield receiver
    receiver.stop()


def _records(team: str, count: int, start: datetime) -> list[TrafficRecord]:
    return [
        TrafficRecord(
            team=team,
            time=start + timedelta(milliseconds=i),
            owner="dev@example.com",
            method="GET",
            host="api.example.com",
            port=443,
            path=f"/v1/items/{i}",
            query_keys=["token"],  # a name; values are never recorded
            decision="deny" if i % 5 == 0 else "allow",
            reason="host_not_allowed" if i % 5 == 0 else None,
        )
        for i in range(count)
    ]


def _ingest(engine: Engine, batches: list[list[TrafficRecord]], parallel: int) -> set[str]:
    def one(batch: list[TrafficRecord]) -> None:
        with Session(engine) as session, session.begin():
            traffic_store.insert_records(session, batch, "scvm-1", datetime.now(UTC))

    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, batches))
    return {str(r.id) for batch in batches for r in batch}


def _audit(engine: Engine, count: int, team: str) -> set[str]:
    seqs = set()
    for i in range(count):
        with Session(engine) as session, session.begin():
            entry = audit.append(
                session,
                actor="admin@example.com",
                team=team,
                action=AuditAction.secret_set,
                target=f"secret/{i}",
                details={"ref": f"s{i}"},
            )
            seqs.add(str(entry.seq))
    return seqs


def _exporter(engine: Engine, otlp: OtlpReceiver, rsyslog: Rsyslog, ca: Path) -> runner.Exporter:
    sinks: list[Sink] = [OtlpSink(otlp.url, ca), SyslogSink(rsyslog.url, ca)]
    return runner.Exporter(engine=engine, sinks=sinks, interval=0.5, batch=100)


def _drain(exporter: runner.Exporter, now: float = 0.0) -> int:
    total = 0
    while (sent := exporter.step(now)) > 0:
        total += sent
    return total


def _ids(events: list[dict[str, object]], log_name: str) -> Counter[str]:
    return Counter(str(e["metadata.uid"]) for e in events if e["metadata.log_name"] == log_name)


def test_each_entry_once_across_outage_and_restart(
    engine: Engine, otlp: OtlpReceiver, rsyslog: Rsyslog, pki: Pki
) -> None:
    team = "t" + uuid.uuid4().hex[:8]
    start = datetime(2026, 12, 1, tzinfo=UTC)
    records = _records(team, 1200, start)
    batches = [records[i : i + 50] for i in range(0, 1200, 50)]
    batches.append(records[:50])  # a shipper's re-send: stored once, exported once
    traffic = _ingest(engine, batches, parallel=4 if engine.dialect.name == "postgresql" else 1)
    audited = _audit(engine, 30, team)

    first = _exporter(engine, otlp, rsyslog, pki.ca)
    assert _drain(first) == 1230 * 2  # both sinks
    assert _ids(otlp.events(), "traffic") == Counter(traffic)
    assert _ids(otlp.events(), "audit") == Counter(audited)
    lines = rsyslog.wait_for(1230)
    assert Counter(e["metadata.uid"] for m, e in lines if m == "traffic") == Counter(traffic)
    assert Counter(e["metadata.uid"] for m, e in lines if m == "audit") == Counter(audited)

    # OTLP receiver down: retried with growing delays; syslog goes on meanwhile.
    otlp.down = True
    later = _records(team, 300, start + timedelta(hours=1))
    traffic |= _ingest(engine, [later[i : i + 100] for i in range(0, 300, 100)], parallel=3)
    clock = 100.0
    while len(otlp.refused) < 5:
        first.step(clock)
        clock += 0.1
    failed = [t for name, t, ok in first.attempts if name == "otlp" and not ok]
    gaps = [b - a for a, b in itertools.pairwise(failed)]
    assert gaps == sorted(gaps) and gaps[-1] > 3 * gaps[0], gaps  # exponential, jittered
    assert len(rsyslog.wait_for(1530)) == 1530
    assert runner.cursor_position(engine, "otlp", Stream.TRAFFIC) < runner.cursor_position(
        engine, "syslog", Stream.TRAFFIC
    )

    # The Console restarts (a new exporter, the cursor from the database), receiver back.
    first.close()
    otlp.down = False
    second = _exporter(engine, otlp, rsyslog, pki.ca)
    assert _drain(second, clock) == 300
    assert _ids(otlp.events(), "traffic") == Counter(traffic)  # each exactly once

    # A crash between the receiver's answer and the cursor's move re-sends that batch only.
    extra = _records(team, 150, start + timedelta(hours=2))
    traffic |= _ingest(engine, [extra], parallel=1)
    save = runner._save_position
    calls = {"n": 0}

    def crash_once(*args: object) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt  # the process dies here
        save(*args)  # type: ignore[arg-type]

    runner._save_position = crash_once  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            second.step(clock)
    finally:
        runner._save_position = save  # type: ignore[assignment]
    second.close()
    third = _exporter(engine, otlp, rsyslog, pki.ca)
    _drain(third, clock)
    third.close()
    counts = _ids(otlp.events(), "traffic")
    assert set(counts) == traffic
    duplicated = {uid for uid, n in counts.items() if n > 1}
    assert len(duplicated) == 100  # the one unacknowledged batch (batch size 100), no more
    assert all(counts[uid] == 2 for uid in duplicated)
    syslog = Counter(e["metadata.uid"] for m, e in rsyslog.wait_for(1680) if m == "traffic")
    assert set(syslog) == traffic and all(n == 1 for n in syslog.values())


def test_mapping_and_no_values(
    engine: Engine, otlp: OtlpReceiver, rsyslog: Rsyslog, pki: Pki
) -> None:
    team = "t" + uuid.uuid4().hex[:8]
    [record] = _records(team, 1, datetime(2026, 12, 1, tzinfo=UTC))
    _ingest(engine, [[record]], parallel=1)
    exporter = _exporter(engine, otlp, rsyslog, pki.ca)
    _drain(exporter)
    exporter.close()
    [event] = otlp.events()
    assert event["class_uid"] == 4002 and event["disposition"] == "Blocked"
    assert event["http_request.url.hostname"] == "api.example.com"
    assert event["actor.user.uid"] == "dev@example.com"
    assert event["status_detail"] == "host_not_allowed"
    [log_record] = otlp.records
    assert log_record["severityText"] == "WARN"
    attributes = {a["key"]: a["value"] for a in log_record["attributes"]}
    assert attributes["http_request.url.port"] == {"intValue": "443"}
    [(msgid, line)] = rsyslog.wait_for(1)
    assert msgid == "traffic" and line == event


def test_a_serving_console_streams_its_audit_without_secret_values(
    request: pytest.FixtureRequest,
    issuer: LocalIssuer,
    otlp: OtlpReceiver,
    rsyslog: Rsyslog,
    pki: Pki,
    tmp_path: Path,
) -> None:
    """The exporter the app's lifespan starts (settings `EXPORT_*`): a secret set through the API
    reaches both receivers as a `secret.set` entry, and its value is in neither."""
    url, sqlite_path = new_database("postgresql", request)
    server = start_server(
        "postgresql",
        url,
        sqlite_path,
        issuer.url,
        generate_key(),
        tmp_path,
        export_otlp_url=otlp.url,
        export_syslog_url=rsyslog.url,
        export_ca_file=pki.ca,
        export_interval_seconds=0.2,
    )
    team = new_team(server, issuer)
    try:
        value = "siem-secret-" + uuid.uuid4().hex
        base = f"/api/v1/teams/{team.name}"
        assert team.admin.put(f"{base}/secrets/bot", json={"value": value}).status_code == 200
        deadline = time.monotonic() + 20
        while not any(e.get("api.operation") == "secret.set" for e in otlp.events()):
            assert time.monotonic() < deadline, "no secret.set entry exported"
            time.sleep(0.1)
        lines = rsyslog.wait_for(len(otlp.events()))
        assert any(e.get("api.operation") == "secret.set" for _, e in lines)
        assert b"".join(otlp.raw).find(value.encode()) == -1
        assert rsyslog.out.read_bytes().find(value.encode()) == -1
    finally:
        team.close()
        server.stop()


def test_export_while_ingesting_loses_nothing(
    engine: Engine, otlp: OtlpReceiver, rsyslog: Rsyslog, pki: Pki
) -> None:
    """Sequence values are taken before their transaction commits; reading while 4 clients
    ingest must still export every record once (the horizon, console/export/runner.py)."""
    team = "t" + uuid.uuid4().hex[:8]
    records = _records(team, 6000, datetime(2026, 12, 1, tzinfo=UTC))
    batches = [records[i : i + 50] for i in range(0, 6000, 50)]
    exporter = _exporter(engine, otlp, rsyslog, pki.ca)
    done = threading.Event()

    def export() -> None:
        while not done.is_set():
            exporter.step(0.0)

    worker = threading.Thread(target=export)
    worker.start()
    parallel = 4 if engine.dialect.name == "postgresql" else 1
    try:
        expected = _ingest(engine, batches, parallel=parallel)
    finally:
        done.set()
        worker.join()
    _drain(exporter)
    exporter.close()
    assert _ids(otlp.events(), "traffic") == Counter(expected)


def test_a_later_sequence_committed_first_does_not_skip_an_earlier_one(
    request: pytest.FixtureRequest, otlp: OtlpReceiver, rsyslog: Rsyslog, pki: Pki
) -> None:
    """Ingest A takes export_seq 1..50 and is still open when ingest B (51..100) commits: an
    exporter reading now must not move its cursor past A's records (PostgreSQL)."""
    url, _ = new_database("postgresql", request)
    db.upgrade(url)
    engine = db.make_engine(url)
    team = "t" + uuid.uuid4().hex[:8]
    # B in another rollup slot than A, or B would wait for A's slot row
    start = datetime(2026, 12, 1, tzinfo=UTC)
    records = _records(team, 50, start) + _records(team, 50, start + timedelta(hours=1))
    exporter = _exporter(engine, otlp, rsyslog, pki.ca)
    try:
        with Session(engine) as slow:
            slow.begin()
            traffic_store.insert_records(slow, records[:50], "scvm-1", datetime.now(UTC))
            _ingest(engine, [records[50:]], parallel=1)
            threading.Timer(1.0, slow.commit).start()  # A commits while the exporter reads
            exporter.step(0.0)
            _drain(exporter)
        assert _ids(otlp.events(), "traffic") == Counter(str(r.id) for r in records)
    finally:
        exporter.close()
        engine.dispose()
