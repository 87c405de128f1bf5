"""Cloud runs hold no database connection during the cloud call (PostgreSQL): a run's claim is a
lease on its row, renewed by the replica's heartbeat, so any number of concurrent launches cannot
starve requests or the server's connections. Before, each run held a connection throughout (first
a pooled one, pool 10 + 20, then one of its own for its advisory job lock)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from sqlalchemy import text

from tests.console.fake_pulumi import FakeClouds
from tests.console.helpers import new_team, start_server, unique
from tests.console.oidc_issuer import LocalIssuer
from tests.console.postgres import PostgresServer
from tests.console.test_providers import APP_COMPOSE, KEY, gcp_settings
from umbra.console.config import GcpProvider
from umbra.policy.bundle import generate_key

RUNS = 3


def test_cloud_runs_hold_no_pooled_connection(
    postgres: PostgresServer, issuer: LocalIssuer, tmp_path: Path
) -> None:
    url = postgres.create_database("j_" + os.urandom(6).hex())
    team_name = "g" + os.urandom(4).hex()
    compose = tmp_path / "app-compose.json"
    compose.write_text(json.dumps(APP_COMPOSE))
    clouds = FakeClouds()
    names = [unique("j")[:10] for _ in range(RUNS)]
    gates = {name: threading.Event() for name in names}
    for name, gate in gates.items():
        clouds.gates[f"-{name}"] = gate
    server = start_server(
        "postgresql", url, None, issuer.url, generate_key(), tmp_path,
        stack_factory=clouds.factory, providers=["local", "gcp"], provider_workers=RUNS,
        gcp=GcpProvider.model_validate(gcp_settings(compose, team_name)),
    )  # fmt: skip
    try:
        team = new_team(server, issuer, team_name)
        ids = []
        for name in names:
            launched = team.dev.post(
                f"/api/v1/teams/{team.name}/cvms",
                json={"name": name, "provider": "gcp", "ssh_keys": [KEY]},
            )
            assert launched.status_code == 201, launched.text
            ids.append(launched.json()["id"])
        # Every run is now inside the (held) cloud call.
        deadline = time.monotonic() + 10
        while sum(stack.config is not None for stack in clouds.stacks.values()) < RUNS:
            assert time.monotonic() < deadline, "runs did not start"
            time.sleep(0.05)
        time.sleep(0.3)
        assert server.console.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        # Nor a connection of its own holding a lock: while the three runs are inside the cloud
        # call no advisory lock is held (before: one session lock, on its own connection, each),
        # and each is claimed by a live lease on its row instead.
        with server.console.engine.connect() as connection:
            locks = connection.execute(
                text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = "
                    "(SELECT oid FROM pg_database WHERE datname = current_database())"
                )
            ).scalar_one()
            leased = connection.execute(
                text("SELECT count(*) FROM cvm WHERE lease_owner = :me AND lease_until > now()"),
                {"me": server.console.leases.replica_id},
            ).scalar_one()
        assert locks == 0
        assert leased == RUNS
        assert team.dev.get(f"/api/v1/teams/{team.name}/cvms").status_code == 200
        for gate in gates.values():
            gate.set()
        deadline = time.monotonic() + 20
        while True:
            states = [team.dev.get(f"/api/v1/cvms/{cvm_id}").json()["state"] for cvm_id in ids]
            if all(state == "running" for state in states):
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.05)
        team.close()
    finally:
        for gate in gates.values():
            gate.set()
        server.stop()


def test_a_dead_process_run_is_taken_over_while_serving(
    postgres: PostgresServer, issuer: LocalIssuer, tmp_path: Path
) -> None:
    """A row left `launching` by a Console process that died (its lease expired) is resumed by a
    serving Console within its reconcile interval, no restart."""
    from datetime import timedelta

    from sqlalchemy.orm import Session

    from tests.console.test_restarts import _cvm
    from umbra.console import db, provisioning
    from umbra.console.models import Cvm, utcnow

    url = postgres.create_database("t_" + os.urandom(6).hex())
    team_name = "g" + os.urandom(4).hex()
    compose = tmp_path / "app-compose.json"
    compose.write_text(json.dumps(APP_COMPOSE))
    clouds = FakeClouds()
    server = start_server(
        "postgresql", url, None, issuer.url, generate_key(), tmp_path,
        stack_factory=clouds.factory, providers=["local", "gcp"], reconcile_interval_seconds=1,
        gcp=GcpProvider.model_validate(gcp_settings(compose, team_name)),
    )  # fmt: skip
    engine = db.make_engine(url)
    try:
        orphan = _cvm(
            "launching", team=team_name, name="orph", ssh_keys=[KEY], lease_owner="dead:1:ab",
            lease_until=utcnow() - timedelta(seconds=1),
        )  # fmt: skip
        orphan_id = orphan.id
        with Session(engine) as session, session.begin():
            session.add(orphan)
        deadline = time.monotonic() + 20
        while True:
            with Session(engine) as session:
                row = session.get(Cvm, orphan_id)
                assert row is not None
                state = row.state
            if state != "launching":
                break
            assert time.monotonic() < deadline, "the orphaned launch was not taken over"
            time.sleep(0.1)
        assert state == "running"
        # A row whose lease another replica still holds is never taken.
        fresh = _cvm("launching", team=team_name, name="fresh", ssh_keys=[KEY], provider="local")
        fresh_id = fresh.id
        with Session(engine) as session, session.begin():
            session.add(fresh)
            session.flush()
            session.execute(
                text(
                    "UPDATE cvm SET lease_owner = 'other:1:ab', "
                    "lease_until = now() + interval '1 hour' WHERE id = :id"
                ),
                {"id": fresh_id},
            )
        assert provisioning.reconcile(server.console) == []
        with Session(engine) as session:
            young = session.get(Cvm, fresh_id)
            assert young is not None and young.state == "launching"
    finally:
        server.stop()
        engine.dispose()
