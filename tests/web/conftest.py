"""Fixtures for the web view: a Console on PostgreSQL (and one on SQLite) seeded through the API
with two teams, developers, CVMs, a bundle, a secret, traffic (some of it hostile) and audit."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.console.helpers import Server, Team, new_team, start_server, traffic_record, unique
from tests.console.oidc_issuer import LocalIssuer
from tests.console.postgres import PostgresServer
from umbra.console import audit
from umbra.console.models import TrafficRecord
from umbra.policy.bundle import generate_key

ARTIFACTS = Path(__file__).parent / "artifacts"
HOSTILE_HOST = '<script>window.__pwned=1</script>"><img src=x onerror="window.__pwned=2">'
HOSTILE_PATH = "/<svg onload=window.__pwned=3>/" + "A" * 1800
SECRET_VALUE = "uwb-secret-value-9f8e7d"  # the test searches every page for it
CONTROL_PATH = "/esc\x1b[31mred\u202edrowssap\u200b/\x7f"


@dataclass
class Seed:
    server: Server
    team: Team
    other: Team  # another team, with its own admin and records
    dev2: httpx.Client
    dev2_subject: str
    cvm1: str  # owned by team.dev
    cvm2: str  # owned by dev2
    hostile_id: str
    control_id: str
    dev2_record: str
    other_record: str


def ingest(team: Team, records: list[dict[str, Any]]) -> None:
    response = team.scvm.post("/api/v1/traffic/batches", json={"records": records})
    assert response.status_code == 200, response.text


def seed(server: Server, issuer: LocalIssuer) -> Seed:
    team = new_team(server, issuer, unique("web"))
    other = new_team(server, issuer, unique("other"))
    dev2_subject = unique("dev2")
    dev2 = server.client(issuer.token(dev2_subject, [f"{team.name}:developer"]))
    assert team.upload(1).status_code == 201
    cvm1 = team.dev_cvm("alpha")
    cvm2 = team.dev_cvm("beta", owner=dev2)
    response = team.admin.put(
        f"/api/v1/teams/{team.name}/secrets/bot",
        json={"value": "initial-value", "hosts": ["api.example.com"]},
    )
    assert response.status_code == 200, response.text
    now = datetime.now(UTC)

    def at(minutes: int) -> str:
        return (now - timedelta(minutes=minutes)).isoformat()

    records = [
        traffic_record(team.name, cvm_id=cvm1, owner=team.dev_subject, time=at(i + 5))
        for i in range(12)
    ]
    records += [
        traffic_record(
            team.name,
            cvm_id=cvm1,
            owner=team.dev_subject,
            time=at(i + 30),
            decision="deny",
            host="evil.example",
            connect_host="evil.example",
            sni="evil.example",
            rule_id=None,
            reason="host_not_allowed",
            status=403,
        )
        for i in range(5)
    ]
    dev2_records = [
        traffic_record(
            team.name,
            cvm_id=cvm2,
            owner=dev2_subject,
            time=at(i + 40),
            host="pypi.org",
            decision="deny" if i % 2 else "allow",
            reason="scan_match" if i % 2 else "rule_allow",
            rule_id="web:egress-0",
        )
        for i in range(6)
    ]
    hostile = traffic_record(
        team.name,
        cvm_id=cvm1,
        owner=team.dev_subject,
        time=at(1),
        host=HOSTILE_HOST,
        path=HOSTILE_PATH,
        decision="deny",
        reason="host_not_allowed",
        detail="<b>bold?</b> &amp; ' \" \u202e",
    )
    ingest(team, [*records, *dev2_records, hostile])
    other_record = traffic_record(other.name, host="other-team.example", time=at(2))
    ingest(other, [other_record])
    # A row with raw control characters, as an older or buggy writer might have stored it.
    control_id = str(uuid.uuid4())
    with server.console.write() as session:
        session.add(
            TrafficRecord(
                id=control_id,
                security_cvm_id=team.scvm_id,
                time=now - timedelta(minutes=3),
                cvm_id=cvm1,
                owner=team.dev_subject,
                team=team.name,
                host="ctl.example",
                path=CONTROL_PATH,
                decision="deny",
                reason="host_not_allowed",
            )
        )
    # The audit entry an attested secret release leaves (the release itself is tested in
    # tests/console with the simulated TEE): the CVM pages derive attestation status from it.
    with server.console.write() as session:
        audit.append(
            session,
            actor=f"security-cvm:{team.scvm_id}",
            team=team.name,
            action="secret.release",
            target=team.scvm_id,
            details={"refs": []},
        )
    return Seed(
        server,
        team,
        other,
        dev2,
        dev2_subject,
        cvm1,
        cvm2,
        hostile["id"],
        control_id,
        dev2_records[0]["id"],
        other_record["id"],
    )


@pytest.fixture(scope="session")
def pg_web(
    postgres: PostgresServer,
    issuer: LocalIssuer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Seed]:
    url = postgres.create_database("uwb_" + uuid.uuid4().hex[:12])
    server = start_server(
        "postgresql", url, None, issuer.url, generate_key(), tmp_path_factory.mktemp("uwb-pg")
    )
    issuer.browser_grant = ("nobody", [])
    try:
        yield seed(server, issuer)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def sqlite_web(issuer: LocalIssuer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seed]:
    folder = tmp_path_factory.mktemp("uwb-sqlite")
    path = folder / "console.db"
    server = start_server("sqlite", f"sqlite:///{path}", path, issuer.url, generate_key(), folder)
    issuer.browser_grant = ("nobody", [])
    try:
        yield seed(server, issuer)
    finally:
        server.stop()


def login(server: Server, issuer: LocalIssuer, subject: str, roles: list[str]) -> httpx.Client:
    """A browser-like HTTP client logged in through the authorization code + PKCE flow."""
    issuer.browser_grant = (subject, roles)
    client = httpx.Client(base_url=server.url, follow_redirects=True, timeout=30)
    response = client.get("/ui/")
    assert response.status_code == 200, response.text
    return client
