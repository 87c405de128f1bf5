"""A frozen PostgreSQL (SIGSTOP: the kernel still acknowledges TCP, the server answers nothing)
makes requests answer 503 with Retry-After within seconds, and the Console serves again once the
server resumes. Before: no connect timeout, no keepalives, no client-side deadline, so requests
waited until the server came back (25 s and more).

Runs its own PostgreSQL: freezing the session's shared one would stall the other tests."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.console.helpers import new_team, start_server
from tests.console.oidc_issuer import LocalIssuer
from tests.console.postgres import PostgresServer, find_bindir
from umbra.policy.bundle import generate_key

PARALLEL = 6


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    bindir = find_bindir()
    assert bindir is not None, "PostgreSQL binaries not found: run scripts/system-deps"
    server = PostgresServer(bindir)
    server.start()
    yield server
    server.stop()


def _server_pids(postgres: PostgresServer) -> list[int]:
    """The postmaster and its children (backends, checkpointer, ...): all of this test's server."""
    postmaster = int((postgres.data / "postmaster.pid").read_text().splitlines()[0])
    pids = [postmaster]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                pids.append(int(entry.name))
    return pids


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def test_frozen_database_answers_503_quickly_then_recovers(
    own_postgres: PostgresServer, issuer: LocalIssuer, tmp_path: Path
) -> None:
    url = own_postgres.create_database("frozen")
    server = start_server("postgresql", url, None, issuer.url, generate_key(), tmp_path)
    team = new_team(server, issuer)
    token = str(team.admin.headers["Authorization"]).removeprefix("Bearer ")
    clients = [server.client(token) for _ in range(PARALLEL)]
    cvms = f"/api/v1/teams/{team.name}/cvms"
    frozen: list[int] = []
    try:
        assert team.admin.get(cvms).status_code == 200
        frozen = _server_pids(own_postgres)
        _signal(frozen, signal.SIGSTOP)

        def timed(client: httpx.Client) -> tuple[int, float, str | None]:
            started = time.monotonic()
            response = client.get(cvms)
            return (
                response.status_code,
                time.monotonic() - started,
                response.headers.get("Retry-After"),
            )

        with ThreadPoolExecutor(PARALLEL) as pool:
            answers = list(pool.map(timed, clients))
        assert [code for code, _, _ in answers] == [503] * PARALLEL, answers
        assert max(seconds for _, seconds, _ in answers) < 8, answers
        assert all(retry for _, _, retry in answers)
        # While it stays frozen, later requests are refused at once.
        code, seconds, _ = timed(clients[0])
        assert code == 503 and seconds < 1, (code, seconds)
    finally:
        _signal(frozen, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while True:
        response = team.admin.get(cvms)
        if response.status_code == 200:
            break
        assert response.status_code == 503, response.text
        assert time.monotonic() < deadline, "the Console did not recover"
        time.sleep(0.2)
    for client in clients:
        client.close()
    team.close()
    server.stop()
