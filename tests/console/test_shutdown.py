"""Shutdown on PostgreSQL: SIGTERM answers waiting long polls cleanly, and a cloud launch that
shutdown interrupts is resumed at the next start exactly as after kill -9.

Before: uvicorn's graceful-shutdown deadline cancelled each waiting long poll (500 and a
traceback apiece), and a launch whose `pulumi` child the shutdown ended was recorded `failed`.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from sqlalchemy.orm import Session

from tests.console.fake_pulumi import FakeClouds
from tests.console.helpers import new_team, start_server, unique
from tests.console.oidc_issuer import LocalIssuer
from tests.console.postgres import PostgresServer, free_port
from tests.console.test_providers import APP_COMPOSE, KEY, gcp_settings
from umbra.console import db
from umbra.console.config import GcpProvider
from umbra.console.models import Cvm
from umbra.console.services.access import CREDENTIAL_PREFIX, credential_hash
from umbra.policy.bundle import generate_key

UMBRA = str(Path(sys.executable).parent / "umbra")
POLLS = 8


def _security_cvm(url: str) -> tuple[str, str]:
    """A Security CVM row with a known credential (as if it had enrolled)."""
    credential = CREDENTIAL_PREFIX + base64.urlsafe_b64encode(os.urandom(32)).decode()
    cvm = Cvm(
        id="cvm_" + os.urandom(8).hex(), team="t" + os.urandom(3).hex(), name="sec",
        kind="security", owner="admin", provider="local", state="running",
        credential_hash=credential_hash(credential), created_by="admin",
    )  # fmt: skip
    cvm_id = cvm.id
    engine = db.make_engine(url)
    with Session(engine) as session, session.begin():
        session.add(cvm)
    engine.dispose()
    return cvm_id, credential


def test_sigterm_answers_waiting_long_polls(
    postgres: PostgresServer, issuer: LocalIssuer, tmp_path: Path
) -> None:
    url = postgres.create_database("s_" + os.urandom(6).hex())
    db.upgrade(url)
    cvm_id, credential = _security_cvm(url)
    port = free_port()
    env = {
        **os.environ,
        "UMBRA_CONSOLE_DATABASE_URL": url,
        "UMBRA_CONSOLE_OIDC_ISSUER": issuer.url,
        "UMBRA_CONSOLE_OIDC_ALLOW_INSECURE_HTTP": "true",
    }
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [UMBRA, "console", "serve", "--port", str(port)], env=env, stdout=sink, stderr=sink
        )
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {credential}"}
    path = f"/api/v1/security-cvms/{cvm_id}/attachments"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        first = httpx.get(base + path, headers=headers, timeout=10)
        assert first.status_code == 200, first.text
        etag = first.headers["ETag"]

        def poll(_: int) -> httpx.Response:
            return httpx.get(
                base + path, params={"wait": 60},
                headers=headers | {"If-None-Match": etag}, timeout=60,
            )  # fmt: skip

        with ThreadPoolExecutor(POLLS) as pool:
            futures = [pool.submit(poll, i) for i in range(POLLS)]
            time.sleep(1.5)  # every poll is waiting now
            assert not any(f.done() for f in futures)
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            responses = [f.result() for f in futures]
        answered = time.monotonic() - signalled
        assert [r.status_code for r in responses] == [304] * POLLS, [r.text for r in responses]
        assert all(r.headers["ETag"] == etag for r in responses)
        assert answered < 3, answered  # not the 5 s graceful-shutdown deadline
        # uvicorn re-raises the captured SIGTERM once shut down.
        assert process.wait(timeout=20) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    output = log.read_text()
    assert "Traceback" not in output and "Exception in ASGI application" not in output, output


def test_launch_interrupted_by_shutdown_resumes_at_next_start(
    postgres: PostgresServer, issuer: LocalIssuer, tmp_path: Path
) -> None:
    url = postgres.create_database("l_" + os.urandom(6).hex())
    team_name = "g" + os.urandom(4).hex()
    compose = tmp_path / "app-compose.json"
    compose.write_text(json.dumps(APP_COMPOSE))
    clouds = FakeClouds()
    options = {
        "stack_factory": clouds.factory,
        "providers": ["local", "gcp"],
        "gcp": GcpProvider.model_validate(gcp_settings(compose, team_name)),
    }
    name = unique("l")[:10]
    gate = clouds.gates[f"-{name}"] = threading.Event()
    # What `pulumi up` reports once shutdown has ended it (the child got SIGTERM).
    clouds.fail_up[f"-{name}"] = "pulumi: signal: terminated"
    server = start_server("postgresql", url, None, issuer.url, generate_key(), tmp_path, **options)
    stopped = False
    try:
        team = new_team(server, issuer, team_name)
        launched = team.dev.post(
            f"/api/v1/teams/{team.name}/cvms",
            json={"name": name, "provider": "gcp", "ssh_keys": [KEY]},
        )
        assert launched.status_code == 201, launched.text
        cvm_id = launched.json()["id"]
        team.close()
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        time.sleep(1.0)  # shutdown is under way (the jobs' grace period is 3 s)
        gate.set()  # the run now fails the way an ended child makes it fail
        stopper.join(timeout=20)
        stopped = True
        engine = db.make_engine(url)
        with Session(engine) as session:
            row = session.get(Cvm, cvm_id)
            assert row is not None and row.state == "launching", (row.state, row.state_reason)
        engine.dispose()
    finally:
        if not stopped:
            gate.set()
            server.stop()
    del clouds.fail_up[f"-{name}"], clouds.gates[f"-{name}"]
    restarted = start_server(
        "postgresql", url, None, issuer.url, generate_key(), tmp_path, **options
    )
    try:
        engine = db.make_engine(url)
        deadline = time.monotonic() + 20
        while True:
            with Session(engine) as session:
                row = session.get(Cvm, cvm_id)
                assert row is not None
                if row.state != "launching":
                    break
            assert time.monotonic() < deadline, "the launch was not resumed"
            time.sleep(0.05)
        assert (row.state, row.state_reason) == ("running", None)
        engine.dispose()
    finally:
        restarted.stop()
