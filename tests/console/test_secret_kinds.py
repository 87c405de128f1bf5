"""Secret kinds on the Console: documents checked field by field (never echoed), sealed like any
value, released with their kind; a rotated refresh token written back under a lease with a
compare-and-swap, so replicas racing on PostgreSQL leave exactly one chain."""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from tests.console import enroll
from tests.console.helpers import CaptureHandler, Server, Team, new_team
from tests.console.oidc_issuer import LocalIssuer
from tests.console.test_release import _evidence, attested, pki  # noqa: F401 (fixtures)
from tests.console.test_secrets import database_bytes, encodings
from tests.console.test_security_pool import register
from umbra.attest.simulator import SimulatedTdx
from umbra.console.release import SUITE
from umbra.contracts.release import ReleaseDocument
from umbra.proxy.secret_puller import _store


def refresh_doc(token: str) -> dict[str, Any]:
    return {
        "token_url": "https://auth.example.com/oauth/token",
        "client_id": "app_123",
        "refresh_token": token,
    }


def google_key_file() -> dict[str, Any]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    # A Google key file as downloaded: its informational fields are accepted and dropped.
    return {
        "type": "service_account",
        "project_id": "p",
        "private_key_id": "k1",
        "private_key": pem,
        "client_email": "sa@p.iam.gserviceaccount.com",
        "client_id": "1",
        "auth_uri": "https://accounts.google.com/o/oauth2/auth",
        "token_uri": "https://oauth2.googleapis.com/token",
        "scopes": ["https://www.googleapis.com/auth/cloud-platform"],
    }


def put(team: Team, name: str, kind: str, document: dict[str, Any], **extra: Any) -> httpx.Response:
    return team.admin.put(
        f"/api/v1/teams/{team.name}/secrets/{name}",
        json={"value": json.dumps(document), "hosts": ["api.example.com"], "kind": kind, **extra},
    )


def release(team: Team, tdx: SimulatedTdx) -> ReleaseDocument:
    key = X25519PrivateKey.generate()
    evidence = _evidence(team, tdx, key)
    response = team.scvm.post(
        f"/api/v1/security-cvms/{team.scvm_id}/secrets/release", json=evidence
    )
    assert response.status_code == 200, response.text
    info = base64.b64decode(response.json()["info"])
    return ReleaseDocument.model_validate_json(
        SUITE.decrypt(base64.b64decode(response.json()["sealed"]), key, info=info)
    )


def test_kinds_are_checked_sealed_and_released(
    server: Server,
    team: Team,
    attested: SimulatedTdx,  # noqa: F811
    log_capture: CaptureHandler,
    request: pytest.FixtureRequest,
) -> None:
    refresh = "rt-" + uuid.uuid4().hex
    client_secret = "cs-" + uuid.uuid4().hex
    aws_secret = "aws-" + uuid.uuid4().hex
    google = google_key_file()
    assert put(team, "codex", "oauth2-refresh", refresh_doc(refresh)).status_code == 200
    cc = {
        "token_url": "https://auth.example.com/token",
        "client_id": "c",
        "client_secret": client_secret,
    }
    assert put(team, "cc", "oauth2-client-credentials", cc).status_code == 200
    assert put(team, "gsa", "google-service-account", google).status_code == 200
    aws = {"access_key_id": "AKIAREALKEY0000001", "secret_access_key": aws_secret}
    listed = put(team, "aws", "aws-sigv4", aws)
    assert listed.status_code == 200, listed.text
    assert listed.json()["kind"] == "aws-sigv4" and listed.json()["status"] == "ok"

    # Bad documents: refused naming the field, never quoting a value.
    bad = [
        ("oauth2-refresh", {**refresh_doc(refresh), "token_url": "http://auth.example.com/t"}),
        ("oauth2-refresh", {**refresh_doc(refresh), "surprise": refresh}),
        ("aws-sigv4", {"access_key_id": "lower-case", "secret_access_key": aws_secret}),
        ("oauth2-client-credentials", {"token_url": "https://a.example/t", "client_id": "c"}),
    ]
    for kind, document in bad:
        answer = put(team, "bad", kind, document)
        assert answer.status_code == 422, answer.text
        assert refresh not in answer.text and aws_secret not in answer.text
    not_json = team.admin.put(
        f"/api/v1/teams/{team.name}/secrets/bad",
        json={"value": refresh, "hosts": [], "kind": "oauth2-refresh"},
    )
    assert not_json.status_code == 422 and refresh not in not_json.text

    released = release(team, attested)
    kinds = {item.ref: item.kind for item in released.secrets}
    assert kinds == {
        "team/codex": "oauth2-refresh",
        "team/cc": "oauth2-client-credentials",
        "team/gsa": "google-service-account",
        "team/aws": "aws-sigv4",
    }
    # The Security CVM's parser takes exactly what the Console released.
    store = _store(released)
    material = store.material("team/codex", "", "api.example.com")
    assert material is not None and material.version == 1
    assert getattr(material.document, "refresh_token") == refresh  # noqa: B009
    assert store.material("team/codex", "", "other.example.com") is None  # bound to its hosts
    scanned = {item.value for item in store.all_values()}
    assert {refresh, client_secret, aws_secret, google["private_key"]} <= scanned
    assert refresh not in repr(store.materials()) and refresh not in str(material.document)

    responses = b"\n".join(server.responses)
    logs = log_capture.text().encode()
    database = list(database_bytes(server, request))
    for value in (refresh, client_secret, aws_secret):
        for form in encodings(value):
            assert form not in responses and form not in logs
            assert all(form not in chunk for chunk in database)


def race(calls: list[Callable[[], httpx.Response]]) -> list[httpx.Response]:
    barrier = threading.Barrier(len(calls))

    def go(call: Callable[[], httpx.Response]) -> httpx.Response:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(go, calls))


@pytest.mark.parametrize("server", ["postgresql"], indirect=True)
def test_parallel_refreshers_leave_one_chain(server: Server, team: Team, tmp_path: Path) -> None:
    """Two enrolled replicas of one pool, eight parallel lease requests for one version: every
    lease granted is one replica's (the other is told to wait, 409); of all granted leases exactly
    one commit lands; the chain advances by one, and the old version cannot be leased again."""
    pool = [register(team, 0), register(team, 1)]
    clients = {
        r["cvm_id"]: server.client(
            enroll.enroll(server.url, team.admin, r["cvm_id"], enroll.SECURITY_IMAGE, tmp_path,
                          token=r["token"])
        )
        for r in pool
    }  # fmt: skip
    team.dev_cvm()  # routed to the pool: both replicas serve the developer
    name = "chain"
    assert put(team, name, "oauth2-refresh", refresh_doc("rt-1")).status_code == 200
    at = {"ref": f"team/{name}", "owner": None, "version": 1}
    try:
        calls = [
            (cvm_id, lambda c=client, i=cvm_id: c.post(
                f"/api/v1/security-cvms/{i}/secret-refresh/lease", json=at))
            for cvm_id, client in clients.items()
            for _ in range(4)
        ]  # fmt: skip
        answers = race([call for _, call in calls])
        granted = [(cvm_id, a.json()["lease"]) for (cvm_id, _), a in zip(calls, answers, strict=True)
                   if a.status_code == 200]  # fmt: skip
        refused = [a.status_code for a in answers if a.status_code != 200]
        assert granted and set(refused) <= {409}, [a.text for a in answers]
        assert len({cvm_id for cvm_id, _ in granted}) == 1  # one replica holds the chain
        document = json.dumps(refresh_doc("rt-2"))

        def commit(cvm_id: str, lease: str) -> Callable[[], httpx.Response]:
            url = f"/api/v1/security-cvms/{cvm_id}/secret-refresh/commit"
            return lambda: clients[cvm_id].post(
                url, json={**at, "lease": lease, "document": document}
            )

        commits = race([commit(cvm_id, lease) for cvm_id, lease in granted])
        assert sorted(c.status_code for c in commits) == [200] + [412] * (len(granted) - 1)
        listed = team.admin.get(f"/api/v1/teams/{team.name}/secrets").json()
        assert [(s["name"], s["version"]) for s in listed if s["name"] == name] == [(name, 2)]
        for cvm_id, client in clients.items():  # the old version is history for everyone
            stale = client.post(f"/api/v1/security-cvms/{cvm_id}/secret-refresh/lease", json=at)
            assert stale.status_code == 412
        entries = team.admin.get(f"/api/v1/teams/{team.name}/audit").json()["entries"]
        assert [e["action"] for e in entries].count("secret.refresh") == 1
        assert "rt-2" not in json.dumps(entries)
    finally:
        for client in clients.values():
            client.close()


@pytest.mark.parametrize("server", ["postgresql"], indirect=True)
def test_refusal_marks_needs_login_and_other_teams_cannot_touch(
    server: Server, issuer: LocalIssuer
) -> None:
    """A refused refresh marks the secret as needing a login (no lease until a new version); a
    Security CVM of another team cannot lease the chain at all."""
    team = new_team(server, issuer)
    other = new_team(server, issuer, name=None)
    try:
        assert put(team, "chain", "oauth2-refresh", refresh_doc("rt-1")).status_code == 200
        at = {"ref": "team/chain", "owner": None, "version": 1}
        base = f"/api/v1/security-cvms/{team.scvm_id}/secret-refresh"
        # A Security CVM of another team cannot touch this team's chain at all.
        foreign = other.scvm.post(
            f"/api/v1/security-cvms/{other.scvm_id}/secret-refresh/lease", json=at
        )
        assert foreign.status_code == 404
        first = team.scvm.post(f"{base}/lease", json=at)
        assert first.status_code == 200
        lease = first.json()["lease"]
        # Refused by the token endpoint: the secret needs a new login and cannot be leased.
        failed = team.scvm.post(
            f"{base}/failure",
            json={**at, "lease": lease, "refused": True, "detail": "invalid_grant"},
        )
        assert failed.status_code == 204, failed.text
        listed = team.admin.get(f"/api/v1/teams/{team.name}/secrets").json()
        assert [s["status"] for s in listed if s["name"] == "chain"] == ["needs_login"]
        assert team.scvm.post(f"{base}/lease", json=at).status_code == 409
        # A new login (a new version) clears it.
        assert put(team, "chain", "oauth2-refresh", refresh_doc("rt-9")).status_code == 200
        listed = team.admin.get(f"/api/v1/teams/{team.name}/secrets").json()
        assert [s["status"] for s in listed if s["name"] == "chain"] == ["ok"]
    finally:
        team.close()
        other.close()
