"""500 Dev CVM launches through the Console's API behind a load balancer: 1, 2 and 4 replicas x
provider workers per replica, side by side in the same run, on one PostgreSQL.

Each mode gets its own database, `--replicas` Console processes (`tests/console/replicas.py`:
`umbra console` apps with the `recorder` provider, a cloud stand-in that answers each launch
after `--delay` seconds, W provider workers per replica, for each W in `--workers`) and HAProxy in front (round
robin). `--clients` client threads POST `--launches` launches through the load balancer (spread
over 4 teams of 4 developers, as a company's would be), then the run waits until every CVM has
left `launching`. Reported per mode: launches per minute (launches ÷ from the first row created
to the last one `running`, database times), p50/p95/p99 time to `running` (a row's `created_at`
to its outcome), p50/p95 of the launch POST itself, and failures. The ratios against the first
mode (1 replica, the first worker count) are the figure;
the machine's CPU count is printed with it (every replica, HAProxy, PostgreSQL and the clients
share those cores).

Run: flock /tmp/umbra-heavy.lock .venv/bin/python benchmarks/console_replicas_bench.py
     [--launches 500] [--clients 32] [--delay 2.0] [--workers 8,16] [--modes 1,2,4]
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from sqlalchemy import text  # noqa: E402

from tests.console.oidc_issuer import LocalIssuer  # noqa: E402
from tests.console.postgres import PostgresServer, find_bindir  # noqa: E402
from tests.console.replicas import Cluster  # noqa: E402
from umbra.console import db  # noqa: E402

TEAMS, DEVELOPERS = 4, 4
TIMEOUT = 900.0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_mode(
    postgres: PostgresServer,
    issuer: LocalIssuer,
    replicas: int,
    workers: int,
    args: argparse.Namespace,
) -> dict[str, float]:
    url = postgres.create_database(f"bench_r{replicas}_{os.urandom(4).hex()}")
    db.upgrade(url)
    settings = {
        "database_url": url,
        "oidc_issuer": issuer.url,
        "oidc_allow_insecure_http": True,
        "kek": {"k1": base64.b64encode(os.urandom(32)).decode()},
        "provider_workers": workers,
        "reconcile_interval_seconds": 5,
    }
    engine = db.make_engine(url)
    with tempfile.TemporaryDirectory(prefix="umbra-replicas-bench-") as tmp:
        cluster = Cluster(settings, Path(tmp), replicas=replicas, delay=args.delay)
        try:
            cluster.start()
            callers = [
                (
                    f"team{t}",
                    issuer.token(
                        f"dev{t}-{d}", [f"team{t}:developer"], exp=int(time.time()) + 3600
                    ),
                )
                for t in range(TEAMS)
                for d in range(DEVELOPERS)
            ]
            clients = [
                httpx.Client(
                    base_url=cluster.url, headers={"Authorization": f"Bearer {token}"}, timeout=60
                )
                for _, token in callers
            ]
            posts: list[float] = []
            failures = 0

            def launch(index: int) -> bool:
                slot = index % len(callers)
                began = time.monotonic()
                try:
                    response = clients[slot].post(
                        f"/api/v1/teams/{callers[slot][0]}/cvms",
                        json={"name": f"b{index:04d}", "provider": "recorder"},
                    )
                except httpx.HTTPError:
                    return False
                posts.append(time.monotonic() - began)
                return response.status_code == 201

            with ThreadPoolExecutor(args.clients) as pool:
                failures = sum(not ok for ok in pool.map(launch, range(args.launches)))
            deadline = time.monotonic() + TIMEOUT
            while True:
                with engine.connect() as connection:
                    busy = connection.execute(
                        text("SELECT count(*) FROM cvm WHERE state = 'launching'")
                    ).scalar_one()
                if busy == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{busy} launches never settled")
                time.sleep(0.2)
            with engine.connect() as connection:
                rows = connection.execute(
                    text("SELECT state, created_at, updated_at FROM cvm")
                ).all()
        finally:
            cluster.stop()
            engine.dispose()
    running = [(c, u) for state, c, u in rows if state == "running"]
    to_running = [(u - c).total_seconds() for c, u in running]
    span = (max(u for _, u in running) - min(c for c, _ in running)).total_seconds()
    return {
        "replicas": replicas,
        "workers": workers,
        "launched": len(running),
        "failed": failures + len(rows) - len(running),
        "per_minute": 60 * len(running) / span if span > 0 else float("nan"),
        "run_p50": statistics.median(to_running),
        "run_p95": _pct(to_running, 0.95),
        "run_p99": _pct(to_running, 0.99),
        "post_p50": statistics.median(posts) * 1000,
        "post_p95": _pct(posts, 0.95) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=500)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--delay", type=float, default=2.0, help="the cloud's seconds per launch")
    parser.add_argument("--workers", default="8,16", help="provider workers per replica, each")
    parser.add_argument("--modes", default="1,2,4", help="replica counts to run, in order")
    args = parser.parse_args()
    bindir = find_bindir()
    if bindir is None:
        raise SystemExit("PostgreSQL binaries not found (scripts/system-deps)")
    postgres = PostgresServer(bindir)
    postgres.start()
    issuer = LocalIssuer()
    try:
        results = [
            run_mode(postgres, issuer, int(m), int(w), args)
            for m in args.modes.split(",")
            for w in args.workers.split(",")
        ]
    finally:
        issuer.close()
        postgres.stop()
    print(
        f"{args.launches} launches, {args.clients} clients, cloud delay {args.delay} s, "
        f"{os.cpu_count()} CPUs (shared by every "
        "replica, HAProxy, PostgreSQL and the clients)"
    )
    print(
        f"{'replicas':>8} {'workers':>7} {'running':>7} {'failed':>6} {'launches/min':>12} "
        f"{'p50 to running':>14} {'p95 to running':>14} {'p99 to running':>14} "
        f"{'POST p50':>9} {'POST p95':>9}"
    )
    for r in results:
        print(
            f"{r['replicas']:>8} {r['workers']:>7} {r['launched']:>7} {r['failed']:>6} "
            f"{r['per_minute']:>12.0f} {r['run_p50']:>12.2f} s {r['run_p95']:>12.2f} s "
            f"{r['run_p99']:>12.2f} s {r['post_p50']:>6.0f} ms {r['post_p95']:>6.0f} ms"
        )
    base = results[0]
    for r in results[1:]:
        print(
            f"{r['replicas']}x{r['workers']} vs {base['replicas']}x{base['workers']}: "
            f"launches/min x{r['per_minute'] / base['per_minute']:.2f}, p99 to running "
            f"x{r['run_p99'] / base['run_p99']:.2f}"
        )


if __name__ == "__main__":
    main()
