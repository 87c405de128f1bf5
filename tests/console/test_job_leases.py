"""Job leases on PostgreSQL (console/leases.py): replicas taking over orphaned jobs in parallel
claim each exactly once, and a run whose lease was taken over records nothing."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session

from tests.console.postgres import PostgresServer
from tests.console.replicas import RecorderProvider, read_journal
from tests.console.test_restarts import _cvm
from umbra.console import db, provisioning
from umbra.console.app import build_console
from umbra.console.config import Settings
from umbra.console.enums import CvmState, Operation
from umbra.console.models import Cvm, utcnow
from umbra.console.state import Console

ORPHANS = 40
REPLICAS = 3


def _consoles(url: str, journal: Path, count: int) -> list[Console]:
    consoles = []
    for _ in range(count):
        console = build_console(Settings(database_url=url, job_lease_seconds=5))
        console.providers["recorder"] = RecorderProvider(journal, 0.0)
        consoles.append(console)
    return consoles


def _close(consoles: list[Console]) -> None:
    for console in consoles:
        console.jobs.shutdown(wait=True)
        console.engine.dispose()


def test_parallel_takeovers_claim_each_orphan_once(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    url = postgres.create_database("l_" + os.urandom(6).hex())
    db.upgrade(url)
    engine = db.make_engine(url)
    journal = tmp_path / "journal"
    dead = utcnow() - timedelta(seconds=1)
    orphans = [
        _cvm("launching", provider="recorder", lease_owner="dead:1:ab", lease_until=dead)
        for _ in range(ORPHANS)
    ]
    ids = {cvm.id for cvm in orphans}
    with Session(engine) as session, session.begin():
        session.add_all(orphans)
    consoles = _consoles(url, journal, REPLICAS)
    try:
        handled: list[list[str]] = [[] for _ in consoles]
        start = threading.Barrier(REPLICAS)

        def take(index: int) -> None:
            start.wait()
            handled[index] = provisioning.reconcile(consoles[index])

        threads = [threading.Thread(target=take, args=(i,)) for i in range(REPLICAS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        claimed = [cvm_id for part in handled for cvm_id in part]
        assert sorted(claimed) == sorted(ids)  # each exactly once, across the three
        deadline = time.monotonic() + 30
        while True:
            with engine.connect() as connection:
                states = dict(connection.execute(text("SELECT id, state FROM cvm")).all())
            if all(state == "running" for state in states.values()):
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.1)
        runs = read_journal(journal)
        assert {cvm_id: len(runs[cvm_id]) for cvm_id in ids} == dict.fromkeys(ids, 1)
        with engine.connect() as connection:
            resumed = connection.execute(
                text("SELECT count(*) FROM audit_entry WHERE action = 'cvm.resumed'")
            ).scalar_one()
            held = connection.execute(
                text("SELECT count(*) FROM cvm WHERE lease_owner IS NOT NULL")
            ).scalar_one()
        assert resumed == ORPHANS and held == 0
        # Nothing left to claim: a second round takes nothing.
        assert all(provisioning.reconcile(console) == [] for console in consoles)
    finally:
        _close(consoles)
        engine.dispose()


def test_a_run_whose_lease_was_taken_over_records_nothing(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    url = postgres.create_database("l_" + os.urandom(6).hex())
    db.upgrade(url)
    engine = db.make_engine(url)
    (console,) = _consoles(url, tmp_path / "journal", 1)
    cvm = _cvm("launching", provider="recorder", lease_owner="other:2:cd", lease_until=utcnow())
    try:
        with Session(engine, expire_on_commit=False) as session, session.begin():
            session.add(cvm)
        spec = provisioning.spec_of(cvm)
        provisioning.finish(console, spec, Operation.launch, CvmState.running, None, None)
        with Session(engine) as session:
            row = session.get(Cvm, cvm.id)
            assert row is not None
            assert (row.state, row.lease_owner) == (CvmState.launching, "other:2:cd")
        # Its own lease: recorded, and the lease cleared.
        with Session(engine) as session, session.begin():
            session.execute(
                text("UPDATE cvm SET lease_owner = :me WHERE id = :id"),
                {"me": console.leases.replica_id, "id": cvm.id},
            )
        provisioning.finish(console, spec, Operation.launch, CvmState.running, None, None)
        with Session(engine) as session:
            row = session.get(Cvm, cvm.id)
            assert row is not None
            assert (row.state, row.lease_owner, row.lease_until) == (CvmState.running, None, None)
    finally:
        _close([console])
        engine.dispose()


def test_renewal_extends_held_leases_and_reports_lost_ones(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    url = postgres.create_database("l_" + os.urandom(6).hex())
    db.upgrade(url)
    engine = db.make_engine(url)
    (console,) = _consoles(url, tmp_path / "journal", 1)
    mine = _cvm("launching", provider="recorder")
    taken = _cvm("launching", provider="recorder")
    try:
        with Session(engine, expire_on_commit=False) as session, session.begin():
            session.add_all([mine, taken])
            console.leases.take(session, mine.id)
            session.execute(
                text("UPDATE cvm SET lease_owner = 'other:3:ef' WHERE id = :id"), {"id": taken.id}
            )
        console.leases.hold(mine.id)
        console.leases.hold(taken.id)
        assert console.leases.renew() == {taken.id}
        assert console.leases.held() == {mine.id}
        with engine.connect() as connection:
            left = connection.execute(
                text("SELECT extract(epoch FROM lease_until - now()) FROM cvm WHERE id = :id"),
                {"id": mine.id},
            ).scalar_one()
        assert 4 < float(left) <= 5
    finally:
        _close([console])
        engine.dispose()
