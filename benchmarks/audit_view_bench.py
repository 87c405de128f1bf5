"""Audit page verification cost at 10k vs 100k entries: the incremental view (what the page does
on each visit) against the full verification (what it did before, and what `umbra console
audit-verify` still does), measured in the same run on the same database.

For each size: a chain of N entries is written straight into a migrated database (hashes computed
as `audit.append` does), a first view moves the checkpoint to the head, then each round appends
`--new` entries and times one incremental view, and times one full verification. Reports medians
in ms and the ratios 100k/10k: the view's stays ~1 (O(new entries)), the full one's ~10 (O(all)).

SQLite by default; `--postgres` starts a throwaway PostgreSQL from the Debian binaries.
Run: .venv/bin/python benchmarks/audit_view_bench.py [--sizes 10000 100000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import insert  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from umbra.console import audit, db  # noqa: E402
from umbra.console.models import AuditEntry  # noqa: E402


def _fill(session: Session, start: int, count: int, prev: str) -> str:
    rows = []
    when = datetime(2026, 1, 1, tzinfo=UTC)
    for seq in range(start + 1, start + count + 1):
        at = when + timedelta(seconds=seq)
        details = {"n": seq, "hosts": ["api.example.com"]}
        digest = audit.entry_hash(
            prev, seq, at, "admin@x", "t", "secret.set", f"team/s{seq}", details
        )
        rows.append(
            {"seq": seq, "time": at, "actor": "admin@x", "team": "t", "action": "secret.set",
             "target": f"team/s{seq}", "details": details, "prev_hash": prev, "hash": digest}
        )  # fmt: skip
        prev = digest
        if len(rows) == 5000:
            session.execute(insert(AuditEntry), rows)
            rows = []
    if rows:
        session.execute(insert(AuditEntry), rows)
    session.commit()
    return prev


def _view(session: Session) -> audit.ChainReport:
    """The page's work: verify after the checkpoint, then move it."""
    report = audit.verify_incremental(session)
    assert report.ok, report
    audit.save_checkpoint(session, report, full=False)
    session.commit()
    return report


def measure(url: str, size: int, rounds: int, new: int) -> tuple[float, float]:
    db.upgrade(url, "head")
    engine = db.make_engine(url)
    try:
        with Session(engine) as session:
            head = _fill(session, 0, size, audit.GENESIS)
            _view(session)  # the first view verifies everything once
            views, fulls = [], []
            count = size
            for _ in range(rounds):
                head = _fill(session, count, new, head)
                count += new
                started = time.perf_counter()
                report = _view(session)
                views.append(time.perf_counter() - started)
                assert report.from_seq == count - new and report.entries == count
                started = time.perf_counter()
                full = audit.verify_database(session)
                fulls.append(time.perf_counter() - started)
                assert full.ok and full.head == head
    finally:
        engine.dispose()
    return statistics.median(views), statistics.median(fulls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs=2, default=[10_000, 100_000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=5, help="Entries appended before each view.")
    parser.add_argument("--postgres", action="store_true")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="umi-audit-bench-") as tmp:
        pg = None
        if args.postgres:
            from tests.console.postgres import PostgresServer, find_bindir

            pg = PostgresServer(find_bindir())
            pg.start()
        try:
            for size in args.sizes:
                if pg is not None:
                    url = pg.create_database(f"audit_{size}")
                else:
                    url = f"sqlite:///{Path(tmp) / f'audit-{size}.db'}"
                results[size] = measure(url, size, args.rounds, args.new)
                view, full = results[size]
                print(f"{size:>7} entries: view {view * 1000:8.2f} ms   full {full * 1000:9.1f} ms")
        finally:
            if pg is not None:
                pg.stop()
    small, large = args.sizes
    (v1, f1), (v2, f2) = results[small], results[large]
    print(f"ratio {large}/{small}: view {v2 / v1:5.2f}x   full {f2 / f1:5.2f}x")
    print(f"at {large}: full/view {f2 / v2:7.0f}x")


if __name__ == "__main__":
    main()
