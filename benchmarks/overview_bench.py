"""The overview page at 1M traffic records: read from the records (before) against read from the
30-minute rollups (after), in the same run on the same PostgreSQL; and what maintaining the
rollups costs an ingest batch.

A throwaway PostgreSQL is migrated to 0009, filled with `--records` records (30 days, 20 CVMs
and owners, 50 hosts, 10 % denied) by one INSERT ... SELECT, then upgraded to head (which
backfills the rollups: its time is reported). For the 24 h, 7 d and 30 d ranges, as the team's
admin and as one developer, it times `queries.overview` with `rollups=False` and `True` (median
of `--rounds`). Then it times `--batches` ingest batches of 1,000 new records with the plain
insert and with the insert that also updates the rollups.

Run: flock /tmp/umbra-heavy.lock .venv/bin/python benchmarks/overview_bench.py
     [--records 1000000] [--rounds 5] [--batches 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from tests.console.postgres import PostgresServer, find_bindir  # noqa: E402
from umbra.console import db, traffic_store  # noqa: E402
from umbra.console.config import Settings  # noqa: E402
from umbra.console.enums import Role  # noqa: E402
from umbra.console.services.access import User  # noqa: E402
from umbra.console.state import Console  # noqa: E402
from umbra.console.web import queries  # noqa: E402
from umbra.contracts.traffic import TrafficRecord  # noqa: E402

TEAM = "bench"
FILL = """
INSERT INTO traffic_record (team, id, security_cvm_id, time, cvm_id, owner, kind, method, host,
    connect_host, sni, path, query_keys, decision, rule_id, reason, status, bytes_sent,
    bytes_received, duration_ms, injected_headers, truncated, scan_rule_ids, received_at)
SELECT 'bench', md5(g::text), 'cvm_scvm', now() - (random() * interval '30 days'),
    'cvm_' || lpad((g %% 20)::text, 16, '0'), 'dev' || (g %% 20), 'http', 'GET',
    'host' || (g %% 50) || '.example', 'host' || (g %% 50) || '.example',
    'host' || (g %% 50) || '.example', '/', '[]',
    CASE WHEN g %% 10 = 0 THEN 'deny' ELSE 'allow' END, 'rule' || (g %% 7),
    CASE WHEN g %% 10 = 0 THEN 'host_not_allowed' ELSE 'rule_allow' END, 200, 0, 0, 1.0,
    '[]', '[]', '[]', now()
FROM generate_series(1, %(n)s) AS g
"""


def _median_ms(call: object, rounds: int) -> float:
    timings = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()  # type: ignore[operator]
        timings.append(time.perf_counter() - started)
    return 1000 * statistics.median(timings)


def _batch(now: datetime) -> list[TrafficRecord]:
    return [
        TrafficRecord.model_validate(
            {
                "id": str(uuid.uuid4()),
                "time": (now - timedelta(seconds=i)).isoformat(),
                "team": TEAM,
                "decision": "deny" if i % 10 == 0 else "allow",
                "method": "GET",
                "host": f"host{i % 50}.example",
                "path": "/",
                "cvm_id": "cvm_" + "0" * 16,
                "owner": "dev0",
                "reason": "host_not_allowed" if i % 10 == 0 else "rule_allow",
                "rule_id": f"rule{i % 7}",
            }
        )
        for i in range(1000)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()
    bindir = find_bindir()
    if bindir is None:
        raise SystemExit("PostgreSQL binaries not found: run scripts/system-deps")
    postgres = PostgresServer(bindir)
    postgres.start()
    try:
        url = postgres.create_database("overview")
        db.upgrade(url, "0009")
        dsn = url.replace("postgresql+psycopg", "postgresql")
        started = time.perf_counter()
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute(FILL, {"n": args.records})  # type: ignore[arg-type]
            connection.execute("ANALYZE traffic_record")
        fill = time.perf_counter() - started
        started = time.perf_counter()
        db.upgrade(url)
        backfill = time.perf_counter() - started
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute("ANALYZE")
        console = Console(
            settings=Settings(database_url=url), engine=db.make_engine(url), oidc=None,
            bundle_keys=[], keyring=None, providers={}, release_verifier=None,
        )  # fmt: skip
        admin = User("admin", {TEAM: Role.admin})
        developer = User("dev3", {TEAM: Role.developer})
        print(
            f"{args.records:,} records filled in {fill:.1f} s; migration backfill {backfill:.1f} s"
        )
        print(f"{'range':<6} {'caller':<10} {'records ms':>11} {'rollups ms':>11} {'speed-up':>9}")
        for label, seconds in (("24h", 86400), ("7d", 604800), ("30d", 2592000)):
            for name, user in (("admin", admin), ("developer", developer)):
                slow = _median_ms(
                    lambda u=user, s=seconds: queries.overview(console, u, TEAM, s, rollups=False),
                    args.rounds,
                )
                fast = _median_ms(
                    lambda u=user, s=seconds: queries.overview(console, u, TEAM, s), args.rounds
                )
                print(f"{label:<6} {name:<10} {slow:>11.1f} {fast:>11.1f} {slow / fast:>8.1f}x")
        plain, rolled = [], []
        with psycopg.connect(dsn) as connection:
            for _ in range(args.batches):
                for statement, timings in (
                    (traffic_store._PG_INSERT, plain),
                    (traffic_store._PG_INSERT_WITH_ROLLUPS, rolled),
                ):
                    batch = _batch(datetime.now(UTC))
                    document = traffic_store.RECORDS.dump_json(batch).decode()
                    started = time.perf_counter()
                    with connection.cursor() as cursor:
                        cursor.execute(
                            statement,  # type: ignore[arg-type]
                            {"scvm": "cvm_scvm", "now": datetime.now(UTC), "doc": document},
                        )
                    connection.commit()
                    timings.append(time.perf_counter() - started)
        p, r = 1000 * statistics.median(plain), 1000 * statistics.median(rolled)
        print(f"ingest of 1,000 records: plain insert {p:.1f} ms, with rollups {r:.1f} ms "
              f"(x{r / p:.2f})")  # fmt: skip
        console.engine.dispose()
    finally:
        postgres.stop()


if __name__ == "__main__":
    main()
