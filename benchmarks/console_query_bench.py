"""Console traffic-query benchmark: the developer's and the dashboard's queries on a traffic log of
millions of rows, with revision 0004's team-scoped indexes against the indexes before it
(`(cvm_id, time)`, `(owner, time)`, `(host, time)` and `(team, time, id)`), measured in the same
run on the same data, reported as a ratio.

Rows are generated server-side (`generate_series`) across 50 teams, 20 owners and 40 CVMs per
team and 200 hosts, over 30 days. Each query is the Console's own (`services.traffic.page`, the API's and the web view's): one
page of 100, newest first, filtered like a developer (`owner`) or the dashboard (`cvm_id`,
`decision`, `reason`, `rule_id`, `host`, a time range).

PostgreSQL: pass --postgres-url, or the script starts a throwaway server (as the tests do).
Run: .venv/bin/python benchmarks/console_query_bench.py [--rows 1000000] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NEW_INDEXES = {
    "ix_traffic_team_cvm_time": "(team, cvm_id, time)",
    "ix_traffic_team_owner_time": "(team, owner, time)",
    "ix_traffic_team_host_time": "(team, host, time)",
    "ix_traffic_team_decision_time": "(team, decision, time)",
    "ix_traffic_team_reason_time": "(team, reason, time)",
    "ix_traffic_team_rule_time": "(team, rule_id, time)",
}
OLD_INDEXES = {
    "ix_traffic_cvm_time": "(cvm_id, time)",
    "ix_traffic_owner_time": "(owner, time)",
    "ix_traffic_host_time": "(host, time)",
}

FILL = """
INSERT INTO traffic_record (team, id, security_cvm_id, time, cvm_id, owner, kind, method, host,
    path, query_keys, decision, rule_id, reason, status, bytes_sent, bytes_received, duration_ms,
    scan_rule_ids, injected_headers, truncated, received_at)
SELECT 't' || mod(g, 50), md5(g::text)::uuid::text, 'cvm_00000000000000aa',
    now() - mod(g, 2592000) * interval '1 second',
    'cvm_' || lpad(to_hex(mod(g / 50, 40)), 16, '0'), 'dev' || mod(g / 50, 20), 'http', 'GET',
    'h' || mod(g, 200) || '.example.com', '/p/' || mod(g, 1000), '[]',
    CASE WHEN mod(g, 10) = 0 THEN 'deny' ELSE 'allow' END,
    CASE WHEN mod(g, 10) = 0 THEN NULL ELSE 'p:egress-' || mod(g, 7) END,
    CASE WHEN mod(g, 10) = 0 THEN 'no_rule' WHEN mod(g, 997) = 0 THEN 'scan_block' ELSE 'rule_allow' END,
    200, 10, 20, 1.5, '[]', '[]', '[]', now()
FROM generate_series(1, %(rows)s) AS g
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--postgres-url")
    args = parser.parse_args()

    from tests.console.postgres import PostgresServer, find_bindir

    pg: PostgresServer | None = None
    url = args.postgres_url
    if url is None:
        bindir = find_bindir()
        if bindir is None:
            raise SystemExit("PostgreSQL binaries not found (apt postgresql)")
        pg = PostgresServer(bindir)
        pg.start()
        url = pg.create_database("ucn_query_bench")
    try:
        run(url, args.rows, args.repeat)
    finally:
        if pg is not None:
            pg.stop()


def run(url: str, rows: int, repeat: int) -> None:
    from sqlalchemy import text

    from umbra.console import db
    from umbra.console.app import build_console
    from umbra.console.config import Settings
    from umbra.console.services import traffic
    from umbra.contracts.traffic import Decision

    db.upgrade(url)
    console = build_console(Settings(database_url=url))
    started = time.perf_counter()
    with console.engine.begin() as connection:
        connection.exec_driver_sql("SET LOCAL statement_timeout = 0")  # the fill takes a while
        connection.exec_driver_sql(FILL.replace("%(rows)s", str(int(rows))))
        connection.exec_driver_sql("ANALYZE traffic_record")
    print(f"{rows:,} rows generated in {time.perf_counter() - started:.1f} s")

    now = datetime.now(UTC)

    def query(**filters: Any) -> object:
        return traffic.page(
            console=console, team="t7", filters=traffic.TrafficFilters(**filters), limit=100
        )

    queries: dict[str, Callable[[], object]] = {
        "developer: own traffic": lambda: query(owner="dev3"),
        "dashboard: one CVM, denies": lambda: query(
            cvm="cvm_" + "0" * 15 + "5", decision=Decision.DENY
        ),
        "dashboard: reason, last day": lambda: query(
            reason="scan_block", since=now - timedelta(days=1)
        ),
        "dashboard: rule": lambda: query(rule="p:egress-3"),
        "dashboard: host": lambda: query(host="h57.example.com"),
    }

    def measure() -> dict[str, float]:
        out = {}
        for name, call in queries.items():
            call()  # warm
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            out[name] = statistics.median(times) * 1000
        return out

    with_new = measure()
    with console.engine.begin() as connection:
        connection.exec_driver_sql("SET LOCAL statement_timeout = 0")
        for name in NEW_INDEXES:
            connection.execute(text(f"DROP INDEX {name}"))
        for name, columns in OLD_INDEXES.items():
            connection.execute(text(f"CREATE INDEX {name} ON traffic_record {columns}"))
        connection.exec_driver_sql("ANALYZE traffic_record")
    baseline = measure()
    print(
        f"{'query (median of ' + str(repeat) + ')':34} {'0003 idx ms':>12} {'0004 idx ms':>12} {'speed-up':>9}"
    )
    for name in queries:
        ratio = baseline[name] / with_new[name]
        print(f"{name:34} {baseline[name]:12.2f} {with_new[name]:12.2f} {ratio:8.1f}x")
    console.engine.dispose()


if __name__ == "__main__":
    main()
