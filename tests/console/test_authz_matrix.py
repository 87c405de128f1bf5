"""Every endpoint x role x team: the expected status for each principal, table-driven against one
Console per database backend. A route missing from the table fails the test."""

from __future__ import annotations

import itertools
import json
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.console import enroll
from tests.console.helpers import Server, standard_bundle, traffic_record, unique
from tests.console.oidc_issuer import LocalIssuer
from umbra.console.release import ReleaseEvidence, ReleaseRefused

USERS = ["admin_a", "dev_a", "admin_b", "dev_b", "nobody", "anonymous"]
MACHINES = ["scvm_a", "scvm_b", "user_token", "anonymous"]


class RefuseAll:
    def verify(self, evidence: ReleaseEvidence, security_cvm_id: str) -> Any:
        raise ReleaseRefused("test verifier refuses everything")


@dataclass
class World:
    server: Server
    team_a: str
    team_b: str
    tokens: dict[str, str | None]
    scvm_a: str
    scvm_a2: str
    scvm_b: str
    dev_cvm: str
    admin_cvm: str
    serial: itertools.count[int]

    clients: dict[str, httpx.Client] = field(default_factory=dict)

    def call(self, who: str, method: str, url: str, **kwargs: Any) -> int:
        if who not in self.clients:
            self.clients[who] = self.server.client(self.tokens[who])
        return self.clients[who].request(method, url, **kwargs).status_code

    def create_cvm(self, owner_token: str, **body: Any) -> dict[str, Any]:
        with self.server.client(self.tokens[owner_token]) as client:
            response = client.post(
                f"/api/v1/teams/{self.team_a}/cvms", json={"name": unique("m"), **body}
            )
            assert response.status_code == 201, response.text
            created: dict[str, Any] = response.json()
            return created


@pytest.fixture(scope="module")
def world(server: Server, issuer: LocalIssuer) -> World:
    team_a, team_b = unique("acme"), unique("beta")
    tokens: dict[str, str | None] = {
        "admin_a": issuer.token("u-admin-a", [f"{team_a}:admin"]),
        "dev_a": issuer.token("u-dev-a", [f"{team_a}:developer"]),
        "admin_b": issuer.token("u-admin-b", [f"{team_b}:admin"]),
        "dev_b": issuer.token("u-dev-b", [f"{team_b}:developer"]),
        "nobody": issuer.token("u-nobody", []),
        "anonymous": None,
    }
    server.console.release_verifier = RefuseAll()
    with server.client(tokens["admin_a"]) as admin:
        bundle = standard_bundle(server.bundle_key, 1)
        assert admin.post(f"/api/v1/teams/{team_a}/bundles", content=bundle).status_code == 201
        scvm_a = admin.post(
            f"/api/v1/teams/{team_a}/cvms", json={"name": "sec", "kind": "security"}
        ).json()
        scvm_a2 = admin.post(
            f"/api/v1/teams/{team_a}/cvms", json={"name": "sec2", "kind": "security"}
        ).json()
        admin_cvm = admin.post(
            f"/api/v1/teams/{team_a}/cvms",
            json={"name": "admins", "security_cvm_id": scvm_a["id"]},
        ).json()
    with server.client(tokens["dev_a"]) as dev:
        dev_cvm = dev.post(
            f"/api/v1/teams/{team_a}/cvms", json={"name": "devs", "security_cvm_id": scvm_a["id"]}
        ).json()
    with server.client(tokens["admin_b"]) as admin:
        scvm_b = admin.post(
            f"/api/v1/teams/{team_b}/cvms", json={"name": "sec", "kind": "security"}
        ).json()
    assert "credential" not in scvm_a  # credentials only after attestation
    with tempfile.TemporaryDirectory(prefix="u11-authz-") as tmp:
        with server.client(tokens["admin_a"]) as admin:
            tokens["scvm_a"] = enroll.security_credential(
                server.url, admin, scvm_a["id"], Path(tmp)
            )
        with server.client(tokens["admin_b"]) as admin:
            tokens["scvm_b"] = enroll.security_credential(
                server.url, admin, scvm_b["id"], Path(tmp)
            )
    tokens["user_token"] = tokens["admin_a"]
    return World(
        server,
        team_a,
        team_b,
        tokens,
        scvm_a["id"],
        scvm_a2["id"],
        scvm_b["id"],
        dev_cvm["id"],
        admin_cvm["id"],
        itertools.count(2),
    )


Case = Callable[[World, str], int]


def expect(*codes: int, principals: list[str] = USERS) -> dict[str, int]:
    return dict(zip(principals, codes, strict=True))


def _fresh_dev_cvm_of(world: World, who: str) -> str:
    owner = who if who in ("admin_a", "dev_a") else "admin_a"
    return str(world.create_cvm(owner)["id"])


def _fresh_personal_secret(world: World, who: str) -> str:
    name = unique("p")
    world.call(who, "PUT", f"/api/v1/teams/{world.team_a}/personal-secrets/{name}",
               json={"value": "v", "hosts": ["example.com"]})  # fmt: skip
    return name


def _fresh_team_secret(world: World) -> str:
    name = unique("t")
    assert world.call("admin_a", "PUT", f"/api/v1/teams/{world.team_a}/secrets/{name}",
                      json={"value": "v"}) == 200  # fmt: skip
    return name


T = "/api/v1/teams/{team}"
# (method, route template) -> (how to call it for a principal, expected status per principal)
USER_MATRIX: dict[tuple[str, str], tuple[Case, dict[str, int]]] = {
    ("GET", "/api/v1/me"): (
        lambda w, p: w.call(p, "GET", "/api/v1/me"),
        expect(200, 200, 200, 200, 200, 401),
    ),
    ("POST", T + "/bundles"): (
        lambda w, p: w.call(
            p,
            "POST",
            f"/api/v1/teams/{w.team_a}/bundles",
            content=standard_bundle(w.server.bundle_key, next(w.serial)),
        ),
        expect(201, 403, 403, 403, 403, 401),
    ),
    ("GET", T + "/bundles"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/teams/{w.team_a}/bundles"),
        expect(200, 200, 403, 403, 403, 401),
    ),
    ("POST", T + "/cvms"): (
        lambda w, p: w.call(
            p, "POST", f"/api/v1/teams/{w.team_a}/cvms", json={"name": unique("n")}
        ),
        expect(201, 201, 403, 403, 403, 401),
    ),
    ("POST", T + "/cvms#security"): (
        lambda w, p: w.call(
            p,
            "POST",
            f"/api/v1/teams/{w.team_a}/cvms",
            json={"name": unique("s"), "kind": "security"},
        ),
        expect(201, 403, 403, 403, 403, 401),
    ),
    ("GET", T + "/cvms"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/teams/{w.team_a}/cvms"),
        expect(200, 200, 403, 403, 403, 401),
    ),
    ("GET", "/api/v1/cvms/{cvm_id}"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/cvms/{w.dev_cvm}"),
        expect(200, 200, 404, 404, 404, 401),
    ),
    ("GET", "/api/v1/cvms/{cvm_id}#admins"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/cvms/{w.admin_cvm}"),
        expect(200, 404, 404, 404, 404, 401),
    ),
    ("GET", "/api/v1/cvms/{cvm_id}/session"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/cvms/{w.dev_cvm}/session"),
        expect(200, 200, 404, 404, 404, 401),
    ),
    ("GET", "/api/v1/cvms/{cvm_id}/session#admins"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/cvms/{w.admin_cvm}/session"),
        expect(200, 404, 404, 404, 404, 401),
    ),
    ("PATCH", "/api/v1/cvms/{cvm_id}"): (
        lambda w, p: w.call(p, "PATCH", f"/api/v1/cvms/{w.dev_cvm}", json={"state": "running"}),
        expect(200, 200, 404, 404, 404, 401),
    ),
    ("PATCH", "/api/v1/cvms/{cvm_id}#reroute"): (
        lambda w, p: w.call(
            p, "PATCH", f"/api/v1/cvms/{w.dev_cvm}", json={"security_cvm_id": w.scvm_a}
        ),
        expect(200, 403, 404, 404, 404, 401),
    ),
    ("DELETE", "/api/v1/cvms/{cvm_id}"): (
        lambda w, p: w.call(p, "DELETE", f"/api/v1/cvms/{_fresh_dev_cvm_of(w, p)}"),
        expect(200, 200, 404, 404, 404, 401),
    ),
    ("POST", "/api/v1/cvms/{cvm_id}/enrollment-token"): (
        lambda w, p: w.call(p, "POST", f"/api/v1/cvms/{w.dev_cvm}/enrollment-token"),
        expect(201, 403, 404, 404, 404, 401),
    ),
    ("POST", T + "/security-replicas/{replica}/enrollment-token"): (
        lambda w, p: w.call(
            p, "POST", f"/api/v1/teams/{w.team_a}/security-replicas/1/enrollment-token"
        ),
        expect(201, 403, 403, 403, 403, 401),
    ),
    ("PUT", "/api/v1/cvms/{cvm_id}/profiles"): (
        lambda w, p: w.call(
            p, "PUT", f"/api/v1/cvms/{w.dev_cvm}/profiles", json={"profiles": ["github"]}
        ),
        expect(200, 403, 404, 404, 404, 401),
    ),
    ("POST", T + "/members/{subject}/deactivate"): (
        lambda w, p: w.call(
            p, "POST", f"/api/v1/teams/{w.team_a}/members/{unique('gone')}/deactivate"
        ),
        expect(200, 403, 403, 403, 403, 401),
    ),
    ("POST", T + "/members/{subject}/reactivate"): (
        lambda w, p: w.call(
            p, "POST", f"/api/v1/teams/{w.team_a}/members/{unique('back')}/reactivate"
        ),
        expect(200, 403, 403, 403, 403, 401),
    ),
    ("GET", T + "/quotas"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/teams/{w.team_a}/quotas"),
        expect(200, 200, 403, 403, 403, 401),
    ),
    ("PUT", T + "/quotas"): (
        lambda w, p: w.call(p, "PUT", f"/api/v1/teams/{w.team_a}/quotas", json={}),
        expect(200, 403, 403, 403, 403, 401),
    ),
    ("GET", T + "/default-profiles"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/teams/{w.team_a}/default-profiles"),
        expect(200, 403, 403, 403, 403, 401),
    ),
    ("PUT", T + "/default-profiles"): (
        lambda w, p: w.call(
            p, "PUT", f"/api/v1/teams/{w.team_a}/default-profiles", json={"profiles": []}
        ),
        expect(200, 403, 403, 403, 403, 401),
    ),
    ("POST", "/api/v1/cvms/{cvm_id}/credential"): (
        lambda w, p: w.call(p, "POST", f"/api/v1/cvms/{w.scvm_a2}/credential"),
        expect(200, 404, 404, 404, 404, 401),
    ),
    ("PUT", T + "/secrets/{name}"): (
        lambda w, p: w.call(p, "PUT", f"/api/v1/teams/{w.team_a}/secrets/bot", json={"value": "x"}),
        expect(200, 403, 403, 403, 403, 401),
    ),
    ("GET", T + "/secrets"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/teams/{w.team_a}/secrets"),
        expect(200, 200, 403, 403, 403, 401),
    ),
    ("DELETE", T + "/secrets/{name}"): (
        lambda w, p: w.call(
            p, "DELETE", f"/api/v1/teams/{w.team_a}/secrets/{_fresh_team_secret(w)}"
        ),
        expect(204, 403, 403, 403, 403, 401),
    ),
    ("PUT", T + "/personal-secrets/{name}"): (
        lambda w, p: w.call(
            p,
            "PUT",
            f"/api/v1/teams/{w.team_a}/personal-secrets/gh",
            json={"value": "x", "hosts": ["github.com"]},
        ),
        expect(200, 200, 403, 403, 403, 401),
    ),
    ("GET", T + "/personal-secrets"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/teams/{w.team_a}/personal-secrets"),
        expect(200, 200, 403, 403, 403, 401),
    ),
    ("DELETE", T + "/personal-secrets/{name}"): (
        lambda w, p: w.call(
            p, "DELETE", f"/api/v1/teams/{w.team_a}/personal-secrets/{_fresh_personal_secret(w, p)}"
        ),
        expect(204, 204, 403, 403, 403, 401),
    ),
    ("GET", T + "/traffic"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/teams/{w.team_a}/traffic"),
        expect(200, 200, 403, 403, 403, 401),
    ),
    ("GET", T + "/traffic#other-owner"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/teams/{w.team_a}/traffic", params={"owner": "x"}),
        expect(200, 403, 403, 403, 403, 401),
    ),
    ("GET", T + "/usage"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/teams/{w.team_a}/usage"),
        expect(200, 200, 403, 403, 403, 401),
    ),
    ("GET", T + "/usage#other-owner"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/teams/{w.team_a}/usage", params={"owner": "x"}),
        expect(200, 403, 403, 403, 403, 401),
    ),
    ("GET", T + "/audit"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/teams/{w.team_a}/audit"),
        expect(200, 403, 403, 403, 403, 401),
    ),
    ("GET", T + "/traffic/quarantine"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/teams/{w.team_a}/traffic/quarantine"),
        expect(200, 403, 403, 403, 403, 401),
    ),
}

S = "/api/v1/security-cvms/{cvm_id}"
REFRESH_AT = {"ref": "team/absent", "owner": None, "version": 1}
REFRESH_DOCUMENT = json.dumps(
    {"token_url": "https://auth.example/t", "client_id": "c", "refresh_token": "rt"}
)
MACHINE_MATRIX: dict[tuple[str, str], tuple[Case, dict[str, int]]] = {
    ("GET", S + "/bundle"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/security-cvms/{w.scvm_a}/bundle"),
        expect(200, 403, 401, 401, principals=MACHINES),
    ),
    ("GET", S + "/attachments"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/security-cvms/{w.scvm_a}/attachments"),
        expect(200, 403, 401, 401, principals=MACHINES),
    ),
    ("GET", S + "/secrets/version"): (
        lambda w, p: w.call(p, "GET", f"/api/v1/security-cvms/{w.scvm_a}/secrets/version"),
        expect(200, 403, 401, 401, principals=MACHINES),
    ),
    ("POST", S + "/release-challenge"): (
        lambda w, p: w.call(p, "POST", f"/api/v1/security-cvms/{w.scvm_a}/release-challenge"),
        expect(200, 403, 401, 401, principals=MACHINES),
    ),
    ("POST", S + "/secrets/release"): (
        lambda w, p: w.call(
            p,
            "POST",
            f"/api/v1/security-cvms/{w.scvm_a}/secrets/release",
            json={"nonce": "A" * 43, "quote": "AA==", "public_key": "A" * 43 + "="},
        ),
        expect(403, 403, 401, 401, principals=MACHINES),
    ),
    # A rotated refresh token written back: only the Security CVM itself (another's credential
    # 403), and only for a secret its release carries (here none: 404).
    ("POST", S + "/secret-refresh/lease"): (
        lambda w, p: w.call(
            p, "POST", f"/api/v1/security-cvms/{w.scvm_a}/secret-refresh/lease", json=REFRESH_AT
        ),
        expect(404, 403, 401, 401, principals=MACHINES),
    ),
    ("POST", S + "/secret-refresh/commit"): (
        lambda w, p: w.call(
            p,
            "POST",
            f"/api/v1/security-cvms/{w.scvm_a}/secret-refresh/commit",
            json=REFRESH_AT | {"lease": "L" * 32, "document": REFRESH_DOCUMENT},
        ),
        expect(404, 403, 401, 401, principals=MACHINES),
    ),
    ("POST", S + "/secret-refresh/failure"): (
        lambda w, p: w.call(
            p,
            "POST",
            f"/api/v1/security-cvms/{w.scvm_a}/secret-refresh/failure",
            json=REFRESH_AT | {"lease": "L" * 32, "refused": True},
        ),
        expect(404, 403, 401, 401, principals=MACHINES),
    ),
    ("POST", "/api/v1/traffic/batches"): (
        lambda w, p: w.call(
            p,
            "POST",
            "/api/v1/traffic/batches",
            json={"records": [traffic_record(w.team_a, id=str(uuid.uuid4()), cvm_id=w.dev_cvm)]},
        ),
        # Another team's Security CVM: accepted, and the record is quarantined in its own team.
        expect(200, 200, 401, 401, principals=MACHINES),
    ),
}

PUBLIC = {
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/api/v1/auth/oidc"),
}
# Authenticated by a one-time enrollment token and a quote, not a principal (tests/up/).
PUBLIC |= {("POST", "/api/v1/enroll/challenge"), ("POST", "/api/v1/enroll")}
# Authenticated by a fresh quote of the CVM's measured launch (tests/console/test_reenrollment.py).
PUBLIC |= {("POST", "/api/v1/enroll/renew/challenge"), ("POST", "/api/v1/enroll/renew")}

USER_CASES = [(route, who) for route in USER_MATRIX for who in USERS]
MACHINE_CASES = [(route, who) for route in MACHINE_MATRIX for who in MACHINES]


def test_matrix_covers_every_route(world: World) -> None:
    routes = {
        (method.upper(), path)
        for path, operations in world.server.app.openapi()["paths"].items()
        for method in operations
    }
    covered = {(m, p.split("#")[0]) for m, p in [*USER_MATRIX, *MACHINE_MATRIX]} | PUBLIC
    assert routes == covered


@pytest.mark.parametrize(
    ("route", "who"), USER_CASES, ids=[f"{m} {p} as {w}" for (m, p), w in USER_CASES]
)
def test_user_endpoint(world: World, route: tuple[str, str], who: str) -> None:
    call, expected = USER_MATRIX[route]
    assert call(world, who) == expected[who]


@pytest.mark.parametrize(
    ("route", "who"), MACHINE_CASES, ids=[f"{m} {p} as {w}" for (m, p), w in MACHINE_CASES]
)
def test_security_cvm_endpoint(world: World, route: tuple[str, str], who: str) -> None:
    call, expected = MACHINE_MATRIX[route]
    assert call(world, who) == expected[who]
