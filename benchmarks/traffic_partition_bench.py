"""The traffic table at 10M records: partitioned by day (revision 0015) against unpartitioned
(revision 0013), in the same run on the same PostgreSQL.

One throwaway PostgreSQL (fsync off, like the tests) holds two databases: `plain` migrated to 0013
and `part` migrated to head, whose day partitions are made for the data's 30 days with
`traffic_partitions.ensure`. `--records` records (one team, 20 CVMs and owners, 50 hosts, 10 %
denied, in time order over the last 30 days) are written once to a CSV file and bulk-loaded into
each with COPY (primary key and indexes dropped first and rebuilt after, then the rollups built
as revision 0011's backfill does). Then, on each database:

- ingest: `--batches` batches of 1,000 new records through the Console's own insert
  (`traffic_store.insert_records`, rollups included), records per second;
- the overview (`web.queries.overview`, the team's admin) for 1 h (read from the records), 24 h,
  7 d and 30 d (from the rollups), p50 and p95 of `--rounds`;
- the traffic list (`services.traffic.page`, a page of 100, newest first): everything, one
  developer's own, one host over the last day; p50 and p95;
- retention (`traffic_retention.run` with 29 days, the oldest day or two expiring, no SIEM sink):
  dropping the expired day partitions against deleting the same rows in batches.

Run: flock /tmp/umbra-heavy.lock .venv/bin/python benchmarks/traffic_partition_bench.py
     [--records 10000000] [--rounds 15] [--batches 30] [--keep-csv PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from sqlmodel import Session  # noqa: E402

from tests.console.postgres import PostgresServer, find_bindir  # noqa: E402
from umbra.console import db, traffic_partitions, traffic_retention, traffic_store  # noqa: E402
from umbra.console.config import Settings  # noqa: E402
from umbra.console.enums import Role  # noqa: E402
from umbra.console.models import TrafficRecord as TrafficRow  # noqa: E402
from umbra.console.services import traffic as traffic_service  # noqa: E402
from umbra.console.services.access import User  # noqa: E402
from umbra.console.state import Console  # noqa: E402
from umbra.console.web import queries  # noqa: E402
from umbra.contracts.traffic import TrafficRecord  # noqa: E402

TEAM = "bench"
DAYS = 30
COLUMNS = (
    "team, id, security_cvm_id, time, cvm_id, owner, kind, method, host, connect_host, sni, path, "
    "query_keys, decision, rule_id, reason, status, bytes_sent, bytes_received, duration_ms, "
    "scan_rule_ids, injected_headers, truncated, received_at"
)
SLOT = 1800
BACKFILL = (
    "INSERT INTO traffic_slot (team, owner, cvm_id, slot, total, denied) "  # noqa: S608
    f"SELECT team, coalesce(owner, ''), coalesce(cvm_id, ''), "
    f"(floor(extract(epoch FROM time) / {SLOT}) * {SLOT})::bigint, count(*), "
    "count(*) FILTER (WHERE decision = 'deny') FROM traffic_record GROUP BY 1, 2, 3, 4",
    "INSERT INTO traffic_slot_denial (team, owner, cvm_id, slot, dimension, value, count) "  # noqa: S608
    f"SELECT team, coalesce(owner, ''), coalesce(cvm_id, ''), "
    f"(floor(extract(epoch FROM time) / {SLOT}) * {SLOT})::bigint, v.dimension, "
    "coalesce(v.value, ''), count(*) FROM traffic_record CROSS JOIN LATERAL (VALUES "
    "('host', host), ('reason', reason), ('rule', rule_id)) AS v(dimension, value) "
    "WHERE decision = 'deny' GROUP BY 1, 2, 3, 4, 5, 6",
)


def write_csv(path: Path, count: int, now: datetime) -> None:
    rng = random.Random(27)
    start = now - timedelta(days=DAYS)
    step = DAYS * 86400 / count
    base = start.timestamp()
    with path.open("w") as out:
        lines = []
        for i in range(count):
            when = datetime.fromtimestamp(base + i * step, UTC).isoformat()
            n = i % 20
            host = f"host{rng.randrange(50)}.example"
            deny = rng.random() < 0.1
            lines.append(
                f"{TEAM},{uuid.UUID(int=rng.getrandbits(128), version=4)},cvm_scvm,{when},"
                f"cvm_{n:016d},dev{n},http,GET,{host},{host},{host},/v1/items,[],"
                f"{'deny' if deny else 'allow'},rule{i % 7},"
                f"{'host_not_allowed' if deny else 'rule_allow'},200,120,3400,12.5,[],[],[],{when}\n"
            )
            if len(lines) >= 100_000:
                out.writelines(lines)
                lines.clear()
        out.writelines(lines)


def load(dsn: str, csv: Path) -> tuple[float, float]:
    """COPY the file in with the key and indexes dropped, then rebuild them; (copy s, index s)."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute("SET maintenance_work_mem = '512MB'")
        names = [
            index.name
            for index in TrafficRow.__table__.indexes  # type: ignore[attr-defined]
        ]
        for name in names:
            connection.execute(f"DROP INDEX {name}")  # type: ignore[arg-type]
        connection.execute("ALTER TABLE traffic_record DROP CONSTRAINT traffic_record_pkey")
        started = time.perf_counter()
        with connection.cursor() as cursor:
            sql = f"COPY traffic_record ({COLUMNS}) FROM STDIN (FORMAT csv)"
            with cursor.copy(sql) as copy, csv.open("rb") as source:  # type: ignore[arg-type]
                while block := source.read(1 << 20):
                    copy.write(block)
        copied = time.perf_counter() - started
        started = time.perf_counter()
        connection.execute(
            "ALTER TABLE traffic_record ADD CONSTRAINT traffic_record_pkey PRIMARY KEY (team, id, time)"
        )
    engine = db.make_engine(dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as connection:
        connection.exec_driver_sql("SET maintenance_work_mem = '512MB'")
        for index in TrafficRow.__table__.indexes:  # type: ignore[attr-defined]
            index.create(connection)
    engine.dispose()
    with psycopg.connect(dsn, autocommit=True) as connection:
        for statement in BACKFILL:
            connection.execute(statement)  # type: ignore[arg-type]
        connection.execute("VACUUM ANALYZE")
    return copied, time.perf_counter() - started


def batch(now: datetime, rng: random.Random) -> list[TrafficRecord]:
    return [
        TrafficRecord.model_validate(
            {
                "id": str(uuid.uuid4()),
                "time": (now - timedelta(milliseconds=i)).isoformat(),
                "team": TEAM,
                "decision": "deny" if i % 10 == 0 else "allow",
                "method": "GET",
                "host": f"host{rng.randrange(50)}.example",
                "path": "/v1/items",
                "cvm_id": f"cvm_{i % 20:016d}",
                "owner": f"dev{i % 20}",
                "reason": "host_not_allowed" if i % 10 == 0 else "rule_allow",
                "rule_id": f"rule{i % 7}",
            }
        )
        for i in range(1000)
    ]


def timed(call: Callable[[], object], rounds: int) -> tuple[float, float]:
    """p50 and p95 in ms (one warm-up call first)."""
    call()
    timings = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        timings.append(1000 * (time.perf_counter() - started))
    timings.sort()
    return statistics.median(timings), timings[
        min(len(timings) - 1, round(0.95 * len(timings)) - 1)
    ]


def measure(url: str, rounds: int, batches: int) -> dict[str, object]:
    engine = db.make_engine(url)
    console = Console(
        settings=Settings(database_url=url), engine=engine, oidc=None, bundle_keys=[],
        keyring=None, providers={}, release_verifier=None,
    )  # fmt: skip
    results: dict[str, object] = {}
    rng = random.Random(1)
    # the Console's ingest: 1,000-record batches, rollups included, one transaction each
    docs = [batch(datetime.now(UTC), rng) for _ in range(batches)]
    started = time.perf_counter()
    for records in docs:
        with Session(engine) as session, session.begin():
            traffic_store.insert_records(session, records, "cvm_scvm", datetime.now(UTC))
    results["ingest /s"] = batches * 1000 / (time.perf_counter() - started)
    admin = User("admin", {TEAM: Role.admin})
    for label, seconds in (("1h", 3600), ("24h", 86400), ("7d", 604800), ("30d", 2592000)):
        results[f"overview {label}"] = timed(
            lambda s=seconds: queries.overview(console, admin, TEAM, s), rounds
        )
    now = datetime.now(UTC)
    for label, filters in (
        ("list: all", traffic_service.TrafficFilters()),
        ("list: one owner", traffic_service.TrafficFilters(owner="dev3")),
        ("list: host, 1 day", traffic_service.TrafficFilters(host="host7.example", since=now - timedelta(days=1))),
    ):  # fmt: skip
        results[label] = timed(
            lambda f=filters: traffic_service.page(
                console=console, team=TEAM, filters=f, limit=100
            ),
            rounds,
        )
    with engine.connect() as connection:
        before = connection.exec_driver_sql("SELECT count(*) FROM traffic_record").scalar_one()
    started = time.perf_counter()
    run = traffic_retention.run(engine, days=DAYS - 1)
    results["retention s"] = time.perf_counter() - started
    assert run is not None
    with engine.connect() as connection:
        after = connection.exec_driver_sql("SELECT count(*) FROM traffic_record").scalar_one()
    results["retention removed"] = before - after
    results["retention dropped"] = len(run.partitions_dropped)
    engine.dispose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--keep-csv", type=Path, default=None, help="reuse/keep the CSV here")
    args = parser.parse_args()
    bindir = find_bindir()
    if bindir is None:
        raise SystemExit("PostgreSQL binaries not found: run scripts/system-deps")
    now = datetime.now(UTC)
    workdir = Path(tempfile.mkdtemp(prefix="umbra-partbench-"))
    csv = args.keep_csv or workdir / "traffic.csv"
    if not csv.exists():
        started = time.perf_counter()
        write_csv(csv, args.records, now)
        print(f"CSV of {args.records:,} records written in {time.perf_counter() - started:.1f} s")
    postgres = PostgresServer(bindir)
    postgres.start()
    report: dict[str, dict[str, object]] = {}
    try:
        urls = {"unpartitioned": postgres.create_database("plain"),
                "partitioned": postgres.create_database("part")}  # fmt: skip
        # The same schema as head but for the partitioning: 0013 plus 0015's key and slot indexes.
        db.upgrade(urls["unpartitioned"], "0013")
        with psycopg.connect(
            urls["unpartitioned"].replace("postgresql+psycopg://", "postgresql://", 1),
            autocommit=True,
        ) as connection:
            connection.execute("CREATE INDEX ix_traffic_slot_slot ON traffic_slot (slot)")
            connection.execute(
                "CREATE INDEX ix_traffic_slot_denial_slot ON traffic_slot_denial (slot)"
            )
        db.upgrade(urls["partitioned"])
        engine = db.make_engine(urls["partitioned"])
        made = traffic_partitions.ensure(engine, now - timedelta(days=DAYS + 1), ahead=DAYS + 3)
        engine.dispose()
        print(f"partitioned: {len(made)} day partitions made ahead of the load")
        for name in ("unpartitioned", "partitioned"):
            dsn = urls[name].replace("postgresql+psycopg://", "postgresql://", 1)
            copied, indexed = load(dsn, csv)
            print(f"{name}: COPY {copied:.1f} s ({args.records / copied:,.0f} records/s), "
                  f"key + indexes + rollups {indexed:.1f} s")  # fmt: skip
            report[name] = measure(urls[name], args.rounds, args.batches)
            report[name]["load /s"] = args.records / copied
    finally:
        postgres.stop()
        if args.keep_csv is None:
            csv.unlink(missing_ok=True)
            os.rmdir(workdir)
    plain, part = report["unpartitioned"], report["partitioned"]
    print(f"\n{args.records:,} records; p50 / p95 ms of {args.rounds} rounds")
    # gain: how many times better the partitioned table did (times: shorter, rates: higher)
    print(f"{'measure':<22} {'unpartitioned':>18} {'partitioned':>18} {'gain':>7}")
    for key in plain:
        a, b = plain[key], part[key]
        if isinstance(a, tuple) and isinstance(b, tuple):
            print(f"{key:<22} {a[0]:>9.1f} / {a[1]:>6.1f} {b[0]:>9.1f} / {b[1]:>6.1f} "
                  f"{a[0] / b[0]:>6.2f}x")  # fmt: skip
        elif isinstance(a, float) and isinstance(b, float):
            gain = b / a if key.endswith("/s") else a / b
            print(f"{key:<22} {a:>18,.1f} {b:>18,.1f} {gain:>6.2f}x")
        else:
            print(f"{key:<22} {a!s:>18} {b!s:>18}")


if __name__ == "__main__":
    main()
