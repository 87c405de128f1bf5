"""The identity provider cannot stall the Console.

With the issuer hanging and many anonymous clients sending tokens with unknown key ids, a valid
user request, a Security CVM's traffic ingest and /healthz all still complete while the issuer
hangs (asserted as behaviour: they finish before the issuer is released, not against timings).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from joserfc.jwk import RSAKey

from tests.console.conftest import new_database
from tests.console.helpers import Server, new_team, start_server, traffic_record
from tests.console.oidc_issuer import LocalIssuer
from umbra.policy.bundle import generate_key

ANONYMOUS_CLIENTS = 60


@pytest.fixture
def stalling(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Server, LocalIssuer]]:
    issuer = LocalIssuer()
    url, path = new_database("sqlite", request)
    server = start_server("sqlite", url, path, issuer.url, generate_key(), tmp_path)
    try:
        yield server, issuer
    finally:
        issuer.stall.clear()
        server.stop()
        issuer.close()


def test_hanging_issuer_and_unknown_kids_do_not_stall(stalling: tuple[Server, LocalIssuer]) -> None:
    server, issuer = stalling
    team = new_team(server, issuer)  # keys fetched while the issuer still answers
    stranger = RSAKey.generate_key(2048)
    stop = threading.Event()
    answered: list[int] = []

    def anonymous(index: int) -> None:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while not stop.is_set():
                token = issuer.token("x", key=stranger, kid=f"unknown-{index}-{uuid.uuid4().hex}")
                response = client.get(
                    f"/api/v1/teams/{team.name}/cvms", headers={"Authorization": f"Bearer {token}"}
                )
                answered.append(response.status_code)

    issuer.stall.set()
    flood = [threading.Thread(target=anonymous, args=(i,)) for i in range(ANONYMOUS_CLIENTS)]
    for thread in flood:
        thread.start()
    try:
        with httpx.Client(base_url=server.url, timeout=8) as probe:
            for _ in range(3):
                assert probe.get("/healthz").status_code == 200
                listed = probe.get(
                    f"/api/v1/teams/{team.name}/cvms",
                    headers={"Authorization": str(team.admin.headers["Authorization"])},
                )
                assert listed.status_code == 200
                ingested = probe.post(
                    "/api/v1/traffic/batches",
                    json={"records": [traffic_record(team.name)]},
                    headers={"Authorization": str(team.scvm.headers["Authorization"])},
                )
                assert ingested.status_code == 200
        assert issuer.stall.is_set()  # all of that happened while the issuer hung
    finally:
        stop.set()
        for thread in flood:
            thread.join(timeout=60)
        team.close()
    assert answered and set(answered) <= {401, 503}
