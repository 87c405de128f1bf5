"""Console traffic-log ingest benchmark: records/s through the real API on PostgreSQL and on
SQLite, measured in the same run, and the ratio between them.

The Console runs in a child process (uvicorn, one worker, as `umbra console serve` would); the
parent posts pre-encoded batches of fresh records from several threads over loopback, the way
Security CVM shippers would, and reports records/s end to end (HTTP, JSON, validation, insert).
A final round re-sends already-stored batches to show idempotent retries cost.

PostgreSQL: pass --postgres-url, or the script starts a throwaway server from the Debian binaries
(as the `postgres` user when run as root), like the tests do.

Run: .venv/bin/python benchmarks/console_ingest_bench.py [--records N] [--batch N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TEAM = "bench"


def _server(url: str, port: int, token: str, scvm_id: str, dev_id: str, workers: int) -> None:
    """Child process: migrate, register one Security CVM and one Dev CVM, serve."""
    from sqlalchemy.orm import Session

    from umbra.console import db
    from umbra.console.config import Settings
    from umbra.console.models import Cvm
    from umbra.console.serve import serve
    from umbra.console.services.access import credential_hash

    db.upgrade(url)
    engine = db.make_engine(url)
    with Session(engine) as session, session.begin():
        common = {"team": TEAM, "owner": "bench", "provider": "local", "state": "running",
                  "created_by": "bench"}  # fmt: skip
        session.add(Cvm(id=scvm_id, name="sec", kind="security",
                        credential_hash=credential_hash(token), **common))  # fmt: skip
        session.add(Cvm(id=dev_id, name="dev", kind="dev", security_cvm_id=scvm_id, **common))
    engine.dispose()
    # serve() refuses to start without an issuer; ingest never consults it.
    settings = Settings(database_url=url, oidc_issuer="https://issuer.invalid")
    serve(settings, "127.0.0.1", port, workers=workers, access_log=False)


def _batches(count: int, size: int, dev_id: str) -> list[bytes]:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    out = []
    for b in range(count):
        records = []
        for i in range(size):
            n = b * size + i
            records.append({
                "id": str(uuid.uuid4()), "time": (start + timedelta(milliseconds=n)).isoformat(),
                "cvm_id": dev_id, "owner": "bench", "team": TEAM,
                "policy_hash": "sha256:" + "ab" * 32, "method": "GET",
                "connect_host": "api.github.com", "sni": "api.github.com", "host": "api.github.com",
                "port": 443, "pinned_ip": "140.82.112.6", "path": f"/repos/acme/x/issues/{n}",
                "query_keys": ["page", "per_page"], "decision": "allow" if n % 7 else "deny",
                "rule_id": "github:egress-1", "reason": "rule_allow", "status": 200,
                "bytes_sent": 512, "bytes_received": 4096, "duration_ms": 12.5,
                "scan_rule_ids": [], "injected_headers": ["Authorization"],
            })  # fmt: skip
        out.append(json.dumps({"records": records}).encode())
    return out


def _post_all(base: str, token: str, batches: list[bytes], threads: int) -> tuple[float, int]:
    inserted = 0
    lock = threading.Lock()
    queue = list(reversed(batches))

    def worker() -> None:
        nonlocal inserted
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        with httpx.Client(base_url=base, headers=headers, timeout=120) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    body = queue.pop()
                response = client.post("/api/v1/traffic/batches", content=body)
                response.raise_for_status()
                with lock:
                    inserted += response.json()["inserted"]

    started = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return time.perf_counter() - started, inserted


def _run(
    name: str, url: str, records: int, batch: int, threads: int, workers: int
) -> dict[str, float]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    token = "umbra_scvm_" + secrets.token_urlsafe(32)
    scvm_id, dev_id = "cvm_" + secrets.token_hex(8), "cvm_" + secrets.token_hex(8)
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", url, str(port), token, scvm_id, dev_id, str(workers)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or child.poll() is not None:
                raise RuntimeError(f"{name}: console did not become ready")
            time.sleep(0.2)
        warm = _batches(4, batch, dev_id)
        _post_all(base, token, warm, threads)
        batches = _batches(records // batch, batch, dev_id)
        elapsed, inserted = _post_all(base, token, batches, threads)
        assert inserted == len(batches) * batch, (inserted, len(batches) * batch)
        retry_elapsed, again = _post_all(base, token, batches[: max(1, len(batches) // 4)], threads)
        assert again == 0
        retried = max(1, len(batches) // 4) * batch
    finally:
        child.terminate()
        child.wait(timeout=30)
    return {"rate": inserted / elapsed, "elapsed": elapsed, "retry_rate": retried / retry_elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=60_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--postgres-url", default=None)
    parser.add_argument(
        "--pg-workers", type=int, default=2, help="Console worker processes on PostgreSQL"
    )
    args = parser.parse_args()

    pg_server = None
    if args.postgres_url is None:
        sys.path.insert(0, str(ROOT))
        from tests.console.postgres import PostgresServer, find_bindir

        bindir = find_bindir()
        if bindir is None:
            sys.exit(
                "PostgreSQL binaries not found: run scripts/system-deps or pass --postgres-url"
            )
        pg_server = PostgresServer(bindir)
        pg_server.start()

    def pg_database(name: str) -> str:
        url: str = args.postgres_url or pg_server.create_database(name)  # type: ignore[union-attr]
        return url

    shape = (args.records, args.batch, args.threads)
    results: dict[str, dict[str, float]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.pg_workers > 1:
                name = f"postgresql x{args.pg_workers}"
                results[name] = _run(name, pg_database("bench_n"), *shape, args.pg_workers)
            results["postgresql x1"] = _run("pg", pg_database("bench_1"), *shape, 1)
            results["sqlite x1"] = _run("sqlite", f"sqlite:///{tmp}/bench.db", *shape, 1)
    finally:
        if pg_server is not None:
            pg_server.stop()
    print(f"console traffic ingest: {args.records} records, batches of {args.batch}, "
          f"{args.threads} shipper threads, loopback HTTP, x = uvicorn worker processes, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    for name, result in results.items():
        print(f"  {name:15s} {result['rate']:10,.0f} records/s  ({result['elapsed']:.2f} s)"
              f"   idempotent re-send: {result['retry_rate']:,.0f} records/s")  # fmt: skip
    sqlite_rate = results["sqlite x1"]["rate"]
    for name, result in results.items():
        if name.startswith("postgresql"):
            print(f"  ratio {name} / sqlite x1: {result['rate'] / sqlite_rate:.2f}x")
    best = max(r["rate"] for n, r in results.items() if n.startswith("postgresql"))
    target = 10_000
    print(f"  PostgreSQL best {best:,.0f} records/s: {'meets' if best >= target else 'MISSES'} "
          f"the {target:,} records/s target")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        _server(
            sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6], int(sys.argv[7])
        )
    else:
        main()
