"""Audited-write latency while anonymous callers flood `/enroll/challenge` with random tokens,
with the refusal audit budget (`ENROLL_REFUSALS_PER_MINUTE`, default 60) against no budget (one
hash-chained entry per refusal: the behaviour before), in the same run on one PostgreSQL.

For each mode a Console (uvicorn, in process) on its own database: the p50/p95 of an audited write
(an admin minting an enrollment token: one `cvm.enrollment_token` entry under the audit chain's
lock) idle, then again while `--flooders` client threads in a separate process send random-token challenges; it reports the
flood's rate, the audit entries the flood appended and the latency ratios flood/idle.

Run: flock /tmp/umbra-heavy.lock .venv/bin/python benchmarks/enroll_flood_bench.py
     [--writes 60] [--flooders 6] [--seconds 20]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import func, select  # noqa: E402
from sqlmodel import col  # noqa: E402

from tests.console.helpers import Server, new_team, start_server  # noqa: E402
from tests.console.oidc_issuer import LocalIssuer  # noqa: E402
from tests.console.postgres import PostgresServer, find_bindir  # noqa: E402
from umbra.console.models import AuditEntry  # noqa: E402
from umbra.policy.bundle import generate_key  # noqa: E402


def _entries(server: Server) -> int:
    with server.console.session() as session:
        count: int = session.execute(
            select(func.count())
            .select_from(AuditEntry)
            .where(col(AuditEntry.action).in_(["cvm.enroll_refused", "cvm.enroll_refused_summary"]))
        ).scalar_one()
    return count


def _writes(server: Server, admin_token: str, cvm_id: str, count: int) -> list[float]:
    timings = []
    with server.client(admin_token) as admin:
        for _ in range(count):
            started = time.perf_counter()
            response = admin.post(f"/api/v1/cvms/{cvm_id}/enrollment-token")
            timings.append(time.perf_counter() - started)
            assert response.status_code == 201, response.text
    return timings


# The flood runs in its own process: its clients must not share the Console's GIL.
FLOOD = """
import secrets, sys, threading, time
import httpx
url, seconds, threads = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
sent = []
def go():
    with httpx.Client(base_url=url) as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            token = "umbra_enr_" + secrets.token_hex(16)
            response = client.post("/api/v1/enroll/challenge", json={"token": token})
            assert response.status_code == 403, response.text
            sent.append(1)
pool = [threading.Thread(target=go) for _ in range(threads)]
for thread in pool:
    thread.start()
for thread in pool:
    thread.join()
print(len(sent))
"""


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    postgres: PostgresServer, issuer: LocalIssuer, budget: int, args: argparse.Namespace
) -> dict[str, float]:
    url = postgres.create_database("flood_" + uuid.uuid4().hex[:10])
    with tempfile.TemporaryDirectory(prefix="umbra-flood-") as tmp:
        server = start_server(
            "postgresql", url, None, issuer.url, generate_key(), Path(tmp),
            enroll_refusals_per_minute=budget,
        )  # fmt: skip
        try:
            team = new_team(server, issuer)
            admin_token = str(team.admin.headers["Authorization"]).removeprefix("Bearer ")
            cvm_id = team.dev_cvm()
            _writes(server, admin_token, cvm_id, 10)  # warm up
            idle = _writes(server, admin_token, cvm_id, args.writes)
            before = _entries(server)
            flood = subprocess.Popen(
                [sys.executable, "-c", FLOOD, server.url, str(args.seconds), str(args.flooders)],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            started = time.perf_counter()
            time.sleep(1.0)  # let the flood reach its rate
            flooded: list[float] = []
            while time.perf_counter() - started < args.seconds - 0.5:
                flooded += _writes(server, admin_token, cvm_id, 5)
            out, _ = flood.communicate(timeout=60)
            assert flood.returncode == 0, "the flood process failed"
            sent = int(out.strip())
            elapsed = time.perf_counter() - started
            appended = _entries(server) - before
            team.close()
        finally:
            server.stop()
    return {
        "idle_p50": _ms(idle, 0.5),
        "idle_p95": _ms(idle, 0.95),
        "flood_p50": _ms(flooded, 0.5),
        "flood_p95": _ms(flooded, 0.95),
        "rate": sent / elapsed,
        "appended": appended,
        "writes": len(flooded),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=60)
    parser.add_argument("--flooders", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    bindir = find_bindir()
    if bindir is None:
        raise SystemExit("PostgreSQL binaries not found: run scripts/system-deps")
    postgres = PostgresServer(bindir)
    postgres.start()
    issuer = LocalIssuer()
    try:
        results = {
            "no budget (before)": measure(postgres, issuer, 10**9, args),
            "budget 60/min": measure(postgres, issuer, 60, args),
        }
    finally:
        issuer.close()
        postgres.stop()
    print(
        f"{'mode':<20} {'flood req/s':>11} {'entries':>8} {'idle p50':>9} {'flood p50':>10} "
        f"{'flood p95':>10} {'p50 x':>6}"
    )
    for mode, r in results.items():
        print(
            f"{mode:<20} {r['rate']:>11.0f} {r['appended']:>8.0f} {r['idle_p50']:>7.1f}ms "
            f"{r['flood_p50']:>8.1f}ms {r['flood_p95']:>8.1f}ms {r['flood_p50'] / r['idle_p50']:>6.2f}"
        )


if __name__ == "__main__":
    main()
