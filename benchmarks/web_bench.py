"""Console web view benchmark: p95 time to render the traffic page on PostgreSQL with 1,000,000
records, unfiltered and under each filter, against the JSON API's traffic query (same rows, same
database) measured in the same run as the baseline.

Two rounds: first with the indexes the current migrations create, then after adding the indexes
the web view's filters want (see PROPOSED below; migration 0004 is where they belong). Each round
reports p50/p95 in ms for the page and for the API, and the page/API ratio.

The Console runs in-process (uvicorn on a thread, as the tests run it) against a throwaway
PostgreSQL started from the Debian binaries; the records are generated server-side with
`generate_series`, spread one second apart (about 11.6 days) over 20 Dev CVMs, 20 owners and
200 hosts; 10% are denials, 0.1% carry the rare reason `scan_match`.

Run: .venv/bin/python benchmarks/web_bench.py [--records N] [--requests N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import text  # noqa: E402

from tests.console.helpers import start_server  # noqa: E402
from tests.console.oidc_issuer import LocalIssuer  # noqa: E402
from tests.console.postgres import PostgresServer, find_bindir  # noqa: E402
from umbra.console.models import Cvm  # noqa: E402
from umbra.console.web.session import SESSION_COOKIE, new_session  # noqa: E402
from umbra.policy.bundle import generate_key  # noqa: E402

TEAM = "bench"
ADMIN = "bench-admin"
CVMS = [f"cvm_{i:016x}" for i in range(1, 21)]
SCVM = "cvm_" + "f" * 16

# The keyset order is (time DESC, id DESC) within a team, so each filter wants an index that
# leads with team and the filtered column and ends with (time, id).
PROPOSED = {
    "ix_traffic_team_decision_time": "(team, decision, time, id)",
    "ix_traffic_team_reason_time": "(team, reason, time, id)",
    "ix_traffic_team_rule_time": "(team, rule_id, time, id)",
    "ix_traffic_team_host_time": "(team, host, time, id)",
    "ix_traffic_team_cvm_time": "(team, cvm_id, time, id)",
    "ix_traffic_team_owner_time": "(team, owner, time, id)",
}

GENERATE = """
INSERT INTO traffic_record (id, security_cvm_id, time, cvm_id, owner, team, kind, method, host,
    connect_host, sni, port, path, query_keys, decision, rule_id, reason, status, bytes_sent,
    bytes_received, duration_ms, scan_rule_ids, injected_headers, received_at)
SELECT md5(g::text)::uuid::text, :scvm, now() - g * interval '1 second',
    'cvm_' || lpad(to_hex(1 + g % 20), 16, '0'), 'owner-' || (g % 20), :team, 'http', 'GET',
    'h-' || ((g * 7) % 200) || '.example', 'h-' || ((g * 7) % 200) || '.example',
    'h-' || ((g * 7) % 200) || '.example', 443, '/path/' || g, '["q"]',
    CASE WHEN g % 10 = 0 THEN 'deny' ELSE 'allow' END,
    CASE WHEN g % 10 = 0 THEN NULL ELSE 'p' || (g % 5) || ':' || 'egress-0' END,
    CASE WHEN g % 1000 = 0 THEN 'scan_match' WHEN g % 10 = 0 THEN 'host_not_allowed'
         ELSE 'rule_allow' END,
    CASE WHEN g % 10 = 0 THEN 403 ELSE 200 END, 100, 2000, 12.5, '[]', '[]', now()
FROM generate_series(1, :n) AS g
"""

CASES: list[tuple[str, dict[str, str], dict[str, str] | None]] = [
    # (name, page filters, the API's equivalent or None when the API has no such filter)
    ("unfiltered", {}, {}),
    ("range 24h", {"range": "24h"}, None),
    ("decision=deny", {"decision": "deny"}, {"decision": "deny"}),
    ("host (0.5%)", {"host": "h-17.example"}, {"host": "h-17.example"}),
    ("cvm (5%)", {"cvm": CVMS[3]}, {"cvm_id": CVMS[3]}),
    ("owner (5%)", {"owner": "owner-3"}, {"owner": "owner-3"}),
    ("reason (0.1%)", {"reason": "scan_match"}, None),
    ("rule (18%)", {"rule": "p2:egress-0"}, None),
    ("host+deny", {"host": "h-10.example", "decision": "deny"}, {"host": "h-10.example", "decision": "deny"}),
]  # fmt: skip


def _timed(client: httpx.Client, path: str, params: dict[str, str], n: int) -> list[float]:
    out = []
    client.get(path, params=params).raise_for_status()  # warm the plan and the cache
    for _ in range(n):
        started = time.perf_counter()
        response = client.get(path, params=params)
        out.append((time.perf_counter() - started) * 1000)
        response.raise_for_status()
    return out


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _round(title: str, web: httpx.Client, api: httpx.Client, n: int) -> list[float]:
    print(f"\n{title}")
    print(f"{'filter':16} {'page p50':>9} {'page p95':>9} {'api p95':>9} {'page/api':>9}  rows")
    p95s = []
    for name, params, api_params in CASES:
        page = _timed(web, f"/ui/teams/{TEAM}/traffic", params, n)
        rows = web.get(f"/ui/teams/{TEAM}/traffic", params=params).text.count("<tr data-id=")
        line = f"{name:16} {_p(page, 50):9.1f} {_p(page, 95):9.1f}"
        if api_params is not None:
            base = _timed(api, f"/api/v1/teams/{TEAM}/traffic", {**api_params, "limit": "50"}, n)
            line += f" {_p(base, 95):9.1f} {_p(page, 95) / _p(base, 95):9.2f}"
        else:
            line += f" {'-':>9} {'-':>9}"
        print(f"{line}  {rows}")
        p95s.append(_p(page, 95))
    # Deep paging: follow the keyset cursor 20 pages down; each page costs the same.
    path, params = f"/ui/teams/{TEAM}/traffic", {"decision": "deny"}
    for _ in range(20):
        html = web.get(path, params=params).text
        marker = 'id="older" href="?'
        query = html.split(marker, 1)[1].split('"', 1)[0].replace("&amp;", "&")
        params = dict(item.split("=", 1) for item in query.split("&"))
    deep = _timed(web, path, params, n)
    print(f"{'deny, page 21':16} {_p(deep, 50):9.1f} {_p(deep, 95):9.1f}")
    return p95s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    bindir = find_bindir()
    if bindir is None:
        sys.exit("web_bench: PostgreSQL binaries not found (apt `postgresql`)")
    postgres = PostgresServer(bindir)
    issuer = LocalIssuer()
    postgres.start()
    server = None
    try:
        url = postgres.create_database("uwb_bench_" + uuid.uuid4().hex[:8])
        server = start_server(
            "postgresql", url, None, issuer.url, generate_key(), Path(tempfile.mkdtemp())
        )
        console = server.console
        started = time.perf_counter()
        with console.write() as session:
            common = {"team": TEAM, "provider": "local", "state": "running", "created_by": ADMIN}
            session.add(Cvm(id=SCVM, name="sec", kind="security", owner=ADMIN, **common))
            for index, cvm_id in enumerate(CVMS):
                session.add(Cvm(id=cvm_id, name=f"dev-{index}", kind="dev", owner=f"owner-{index}",
                                security_cvm_id=SCVM, **common))  # fmt: skip
            session.flush()
            session.execute(text(GENERATE), {"scvm": SCVM, "team": TEAM, "n": args.records})
        with console.engine.connect() as connection:
            connection.execute(text("ANALYZE traffic_record"))
            connection.commit()
        print(f"{args.records} records generated in {time.perf_counter() - started:.1f} s")
        web_session = new_session(ADMIN, {TEAM: "admin"}, int(time.time()) + 3600)
        cookie = server.app.state.web_keys.seal_session(web_session)
        web = httpx.Client(base_url=server.url, cookies={SESSION_COOKIE: cookie}, timeout=60)
        api = server.client(issuer.token(ADMIN, [f"{TEAM}:admin"]))
        with web, api:
            before = _round("Round 1: indexes from the current migrations", web, api, args.requests)
            started = time.perf_counter()
            with console.engine.connect() as connection:
                for name, columns in PROPOSED.items():
                    connection.execute(text(f"CREATE INDEX {name} ON traffic_record {columns}"))
                connection.execute(text("ANALYZE traffic_record"))
                connection.commit()
            print(f"\nproposed indexes built in {time.perf_counter() - started:.1f} s")
            after = _round("Round 2: with the proposed indexes", web, api, args.requests)
        print(
            f"\nworst page p95: {max(before):.1f} ms before, {max(after):.1f} ms after "
            f"(target < 200 ms)"
        )
    finally:
        if server is not None:
            server.stop()
        postgres.stop()
        issuer.close()


if __name__ == "__main__":
    main()
