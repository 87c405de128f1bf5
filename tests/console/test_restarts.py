"""Restarts: interrupted provider runs are reconciled at start, `serve` refuses what cannot work,
SIGTERM ends the server (and its provider children) within seconds, and `--workers 2` serves the
same CVMs from either worker (no state lives only in one process's memory)."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from tests.console.helpers import start_server, unique
from tests.console.oidc_issuer import LocalIssuer
from tests.console.postgres import PostgresServer, free_port
from umbra.console import db
from umbra.console.models import Cvm
from umbra.policy.bundle import generate_key

UMBRA = str(Path(sys.executable).parent / "umbra")


def _cvm(state: str, **fields: Any) -> Cvm:
    values: dict[str, Any] = {
        "id": "cvm_" + os.urandom(8).hex(),
        "team": "t",
        "name": unique("n"),
        "kind": "dev",
        "owner": "alice",
        "provider": "gcp",
        "state": state,
        "created_by": "alice",
    }
    return Cvm(**(values | fields))


def test_interrupted_runs_are_reconciled_at_start(
    postgres: PostgresServer, issuer: LocalIssuer, tmp_path: Path
) -> None:
    url = postgres.create_database("r_" + os.urandom(6).hex())
    db.upgrade(url)
    rows = {state: _cvm(state) for state in ("launching", "updating", "destroying", "running")}
    # Another replica is still running this one: its lease is live (database time).
    live = _cvm("launching", lease_owner="other-replica:1:ab")
    engine = db.make_engine(url)
    from sqlalchemy.orm import Session

    with Session(engine, expire_on_commit=False) as session, session.begin():
        session.add_all([*rows.values(), live])
        session.flush()
        session.execute(
            text("UPDATE cvm SET lease_until = now() + interval '1 hour' WHERE id = :id"),
            {"id": live.id},
        )
    server = start_server("postgresql", url, None, issuer.url, generate_key(), tmp_path)
    try:
        with engine.connect() as connection:
            states = {r[0]: r[1] for r in connection.execute(text("SELECT id, state FROM cvm"))}
            reasons = {
                r[0]: r[1] for r in connection.execute(text("SELECT id, state_reason FROM cvm"))
            }
        for state in ("launching", "updating", "destroying"):
            assert states[rows[state].id] == "failed"
            operation = {"launching": "launch", "updating": "update", "destroying": "destroy"}
            assert reasons[rows[state].id].startswith(f"{operation[state]}: interrupted")
        assert states[rows["running"].id] == "running"
        assert states[live.id] == "launching"  # a live run is never failed under its feet
    finally:
        server.stop()
        engine.dispose()


def test_interrupted_cloud_runs_are_resumed_at_start(
    postgres: PostgresServer, issuer: LocalIssuer, tmp_path: Path
) -> None:
    """A resumable provider's interrupted runs are submitted again at start (same operation, read
    back from the row and its audit), and end as a finished run would."""
    from sqlalchemy.orm import Session

    from tests.console.fake_pulumi import FakeClouds
    from tests.console.test_providers import APP_COMPOSE, KEY, gcp_settings
    from umbra.console import audit
    from umbra.console.config import GcpProvider

    url = postgres.create_database("r_" + os.urandom(6).hex())
    db.upgrade(url)
    team = "g" + os.urandom(4).hex()
    compose = tmp_path / "app-compose.json"
    compose.write_text(json.dumps(APP_COMPOSE))
    clouds = FakeClouds()
    stack = f"acme-org/umbra-dev-cvm/{team}-alice-stp"
    clouds.factory(stack, None, True)  # the stack the interrupted stop was changing
    launching = _cvm("launching", team=team, name="lnch", ssh_keys=[KEY])
    stopping = _cvm("updating", team=team, name="stp", ssh_keys=[KEY], provider_ref=stack)
    engine = db.make_engine(url)
    with Session(engine, expire_on_commit=False) as session, session.begin():
        session.add_all([launching, stopping])
        audit.append(session, actor="alice", team=team, action="cvm.update", target=stopping.id,
                     details={"state": "stopped"})  # fmt: skip
    server = start_server(
        "postgresql", url, None, issuer.url, generate_key(), tmp_path,
        stack_factory=clouds.factory, providers=["local", "gcp"],
        gcp=GcpProvider.model_validate(gcp_settings(compose, team)),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            with engine.connect() as connection:
                rows = {
                    r[0]: (r[1], r[2])
                    for r in connection.execute(text("SELECT id, state, provider_ref FROM cvm"))
                }
            if all(state not in ("launching", "updating") for state, _ in rows.values()):
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.05)
        assert rows[launching.id] == ("running", f"acme-org/umbra-dev-cvm/{team}-alice-lnch")
        assert rows[stopping.id] == ("stopped", stack)
        assert clouds.stacks[stack].config["umbra:running"] == "false"
        with engine.connect() as connection:
            trail = [
                (r[0], r[1], json.loads(r[2]) if isinstance(r[2], str) else r[2])
                for r in connection.execute(
                    text("SELECT target, action, details FROM audit_entry ORDER BY seq")
                )
            ]
        assert [(a, d) for t, a, d in trail if t == stopping.id] == [
            ("cvm.update", {"state": "stopped"}),
            ("cvm.resumed", {"operation": "stop", "state": "updating"}),
            ("cvm.provisioned", {"operation": "stop", "state": "stopped"}),
        ]
        assert [a for t, a, _ in trail if t == launching.id] == [
            "cvm.resumed",
            "cvm.enrollment_token",  # the resumed launch's launch data gets a fresh token
            "cvm.provisioned",
        ]
        config = clouds.stacks[rows[launching.id][1]].config
        assert json.loads(config["umbra:devCvm"])["spec"]["enrollment_token"].startswith("enr_")
    finally:
        server.stop()
        engine.dispose()


def test_serve_refuses_unmigrated_database_and_missing_issuer(postgres: PostgresServer) -> None:
    url = postgres.create_database("u_" + os.urandom(6).hex())
    env = {**os.environ, "UMBRA_CONSOLE_DATABASE_URL": url}
    env.pop("UMBRA_CONSOLE_OIDC_ISSUER", None)
    result = subprocess.run([UMBRA, "console", "serve"], env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert "UMBRA_CONSOLE_OIDC_ISSUER" in " ".join(result.stderr.split())
    env["UMBRA_CONSOLE_OIDC_ISSUER"] = "https://issuer.invalid"
    result = subprocess.run([UMBRA, "console", "serve"], env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert "umbra console migrate` or start with --migrate" in " ".join(result.stderr.split())


@pytest.fixture
def two_workers(
    postgres: PostgresServer, issuer: LocalIssuer
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    url = postgres.create_database("w_" + os.urandom(6).hex())
    port = free_port()
    env = {
        **os.environ,
        "UMBRA_CONSOLE_DATABASE_URL": url,
        "UMBRA_CONSOLE_OIDC_ISSUER": issuer.url,
        "UMBRA_CONSOLE_OIDC_ALLOW_INSECURE_HTTP": "true",
        "UMBRA_CONSOLE_WEB_SESSION_KEY": base64.b64encode(os.urandom(32)).decode(),
    }
    process = subprocess.Popen(
        [UMBRA, "console", "serve", "--port", str(port), "--workers", "2", "--migrate"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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
            assert process.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.2)
        yield base, process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def test_two_workers_then_sigterm(
    two_workers: tuple[str, subprocess.Popen[bytes]], issuer: LocalIssuer
) -> None:
    base, process = two_workers
    team = unique("team")
    token = issuer.token(unique("dev"), [f"{team}:developer"])
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}) as client:
        ids = []
        for _ in range(4):
            response = client.post(f"/api/v1/teams/{team}/cvms", json={"name": unique("d")})
            assert response.status_code == 201, response.text
            ids.append(response.json()["id"])
        # New connections land on either worker: every one serves every CVM.
        for cvm_id in ids:
            for state in ("stopped", "running"):
                with httpx.Client(base_url=base, headers=client.headers) as fresh:
                    patched = fresh.patch(f"/api/v1/cvms/{cvm_id}", json={"state": state})
                    assert patched.status_code == 200, patched.text
            assert client.delete(f"/api/v1/cvms/{cvm_id}").status_code == 200
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) is not None  # ends within the graceful-shutdown bound


def test_provider_children_are_ended(tmp_path: Path) -> None:
    """What the Console does at shutdown: every descendant (a `pulumi` and its plugins) ends."""
    script = textwrap.dedent(
        """
        import subprocess, sys
        from umbra.console.children import descendants, terminate_descendants
        child = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"])
        import time; time.sleep(0.3)
        before = descendants()
        print(len(before), terminate_descendants(grace=1.0), flush=True)
        child.wait(timeout=5)
        print(*before)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    counts, pids = result.stdout.splitlines()
    assert int(counts.split()[0]) >= 3
    for pid in map(int, pids.split()):
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split(") ")[1].startswith("Z")
