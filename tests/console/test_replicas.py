"""Three Console processes on one PostgreSQL behind HAProxy, parallel clients launching through
the load balancer with a recording cloud stand-in, one replica killed with SIGKILL mid-run:
every launch ends in exactly one terminal state, no job ever runs on two replicas at once, the
killed replica's jobs are taken over once each after their leases expire, and long polls keep
answering through the load balancer (console.md "Replicas")."""

from __future__ import annotations

import base64
import itertools
import json
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from tests.console.helpers import new_team, start_server
from tests.console.oidc_issuer import LocalIssuer
from tests.console.postgres import PostgresServer
from tests.console.replicas import HAPROXY, Cluster, read_journal
from umbra.console import db
from umbra.policy.bundle import generate_key

pytestmark = pytest.mark.skipif(
    not Path(HAPROXY).exists(), reason="haproxy is not installed (scripts/system-deps)"
)
LAUNCHES = 48
CLIENTS = 8
DELAY = 1.5  # the recorder's seconds per launch: long enough to kill a replica mid-run
LEASE = 3.0


def _launch(client: httpx.Client, team: str, body: dict[str, Any]) -> str:
    """POST through the load balancer; a request the killed replica never answered is retried,
    and a retry that finds the name taken means the first one committed."""
    for _ in range(20):
        try:
            response = client.post(f"/api/v1/teams/{team}/cvms", json=body)
        except httpx.TransportError:
            time.sleep(0.2)
            continue
        if response.status_code == 201:
            return str(response.json()["id"])
        if response.status_code == 409:
            listed = client.get(f"/api/v1/teams/{team}/cvms").json()
            return next(c["id"] for c in listed if c["name"] == body["name"])
        assert response.status_code in (502, 503), response.text
        time.sleep(0.2)
    raise AssertionError(f"launch of {body['name']} never answered")


def test_replicas_behind_a_load_balancer_survive_a_kill(
    postgres: PostgresServer, issuer: LocalIssuer, tmp_path: Path
) -> None:
    url = postgres.create_database("rep_" + os.urandom(6).hex())
    bundle_key = generate_key()
    # The team and its enrolled Security CVM come from an in-process Console (enrollment needs the
    # test's simulated PKI); it stops before the replicas start.
    setup = start_server("postgresql", url, None, issuer.url, bundle_key, tmp_path)
    try:
        team = new_team(setup, issuer)
        credential = team.scvm.headers["Authorization"]
        team_name, scvm_id, dev_subject = team.name, team.scvm_id, team.dev_subject
        team.close()
    finally:
        setup.stop()
    settings = {
        "database_url": url,
        "oidc_issuer": issuer.url,
        "oidc_allow_insecure_http": True,
        "oidc_jwks_min_refresh_seconds": 0,
        "bundle_public_keys": [str(tmp_path / "bundle.pub")],
        "kek": {"k1": base64.b64encode(os.urandom(32)).decode()},
        "long_poll_db_interval_seconds": 0.25,
        "job_lease_seconds": LEASE,
        "reconcile_interval_seconds": 0.5,
        "provider_workers": 16,
    }
    cluster = Cluster(settings, tmp_path, replicas=3, delay=DELAY)
    engine = db.make_engine(url)
    try:
        cluster.start()
        token = issuer.token(dev_subject, [f"{team_name}:developer"])
        headers = {"Authorization": f"Bearer {token}"}
        scvm_headers = {"Authorization": credential}
        polls: list[tuple[float, int]] = []  # (answered at, status)
        stop_polls = threading.Event()

        def long_poll() -> None:
            with httpx.Client(base_url=cluster.url, headers=scvm_headers, timeout=20) as client:
                etag = None
                while not stop_polls.is_set():
                    try:
                        response = client.get(
                            f"/api/v1/security-cvms/{scvm_id}/attachments",
                            params={"wait": 2},
                            headers={"If-None-Match": etag} if etag else {},
                        )
                    except httpx.TransportError:
                        polls.append((time.time(), 0))
                        continue
                    polls.append((time.time(), response.status_code))
                    etag = response.headers.get("ETag", etag)

        def launch(index: int) -> str:
            with httpx.Client(base_url=cluster.url, headers=headers, timeout=30) as client:
                body = {"name": f"l{index:03d}", "provider": "recorder", "security_cvm_id": scvm_id}
                return _launch(client, team_name, body)

        pollers = [threading.Thread(target=long_poll, daemon=True) for _ in range(3)]
        for poller in pollers:
            poller.start()
        victim = cluster.processes[1].pid
        killed_at = 0.0
        with ThreadPoolExecutor(CLIENTS) as clients:
            futures = [clients.submit(launch, i) for i in range(LAUNCHES)]
            # Kill the victim once it has runs in flight (started, not ended).
            deadline = time.monotonic() + 30
            while True:
                runs = read_journal(cluster.journal)
                live = [r for rs in runs.values() for r in rs if r.pid == victim and r.end is None]
                if len(live) >= 2:
                    break
                failed = [f for f in futures if f.done() and f.exception() is not None]
                assert not failed, failed[0].exception()
                assert time.monotonic() < deadline, "the victim never ran a job"
                time.sleep(0.05)
            cluster.kill(1)
            killed_at = time.time()
            ids = [future.result(timeout=120) for future in futures]
        assert len(set(ids)) == LAUNCHES
        # Every launch settles: the killed replica's after its lease expires.
        deadline = time.monotonic() + 60
        while True:
            with engine.connect() as connection:
                states = dict(
                    connection.execute(
                        text("SELECT id, state FROM cvm WHERE provider = 'recorder'")
                    ).all()
                )
            if len(states) == LAUNCHES and all(s != "launching" for s in states.values()):
                break
            assert time.monotonic() < deadline, Counter(states.values())
            time.sleep(0.2)
        # Long polls issued after the kill still answer (the load balancer has dropped the dead
        # replica); one in flight on it at the kill may fail.
        time.sleep(2.5)
        stop_polls.set()
        for poller in pollers:
            poller.join(timeout=10)

        assert set(states) == set(ids)
        assert set(states.values()) == {"running"}, Counter(states.values())
        with engine.connect() as connection:
            trail = connection.execute(
                text(
                    "SELECT target, action FROM audit_entry WHERE action IN "
                    "('cvm.provisioned', 'cvm.resumed') ORDER BY seq"
                )
            ).all()
            leases = connection.execute(
                text("SELECT count(*) FROM cvm WHERE lease_owner IS NOT NULL")
            ).scalar_one()
        assert leases == 0
        provisioned = Counter(t for t, a in trail if a == "cvm.provisioned")
        resumed = Counter(t for t, a in trail if a == "cvm.resumed")
        assert all(provisioned[i] == 1 for i in ids), provisioned  # exactly one outcome each

        runs = read_journal(cluster.journal)
        interrupted = {i for i in ids if any(r.pid == victim and r.end is None for r in runs[i])}
        assert len(interrupted) >= 2
        # The killed replica's jobs (the interrupted runs, and any it had leased but not yet
        # started) are taken over exactly once each; no other job is.
        assert interrupted <= set(resumed) and all(n == 1 for n in resumed.values()), resumed
        for cvm_id in ids:
            spans = sorted(
                (r.start, r.end if r.end is not None else killed_at) for r in runs[cvm_id]
            )
            # Never two runs of one job at once (the takeover starts after the kill).
            for (_, first_end), (second_start, _) in itertools.pairwise(spans):
                assert second_start >= first_end, (cvm_id, runs[cvm_id])
            assert any(r.end is not None for r in runs[cvm_id])
            ran_on_victim = any(r.pid == victim for r in runs[cvm_id])
            again = cvm_id in resumed and ran_on_victim
            assert len(runs[cvm_id]) == 1 + again, runs[cvm_id]
        after = [status for at, status in polls if at > killed_at + 1.5]
        assert after and set(after) <= {200, 304}, Counter(after)
        before = [status for at, status in polls if at < killed_at]
        assert 200 in {s for _, s in polls} and before
    finally:
        cluster.stop()
        engine.dispose()


def test_journal_reader_pairs_starts_and_ends(tmp_path: Path) -> None:
    journal = tmp_path / "j"
    journal.write_text("start a 1 1.0\nstart b 2 1.5\nend a 1 2.0\nstart a 3 9.0\nend a 3 10.0\n")
    runs = read_journal(journal)
    assert [(r.pid, r.start, r.end) for r in sorted(runs["a"], key=lambda r: r.start)] == [
        (1, 1.0, 2.0),
        (3, 9.0, 10.0),
    ]
    assert [(r.pid, r.end) for r in runs["b"]] == [(2, None)]
    assert json.dumps(sorted(runs)) == '["a", "b"]'
