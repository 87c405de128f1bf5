"""The Console starts on both backends, migrated, and answers health, readiness and identity."""

from __future__ import annotations

from tests.console.helpers import Server
from tests.console.oidc_issuer import LocalIssuer


def test_health_ready_and_me(server: Server, issuer: LocalIssuer) -> None:
    with server.client() as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/readyz").json() == {"status": "ready"}
        assert client.get("/api/v1/me").status_code == 401
    token = issuer.token("alice", ["acme:admin", "beta:developer", "bogus"])
    with server.client(token) as client:
        me = client.get("/api/v1/me")
        assert me.status_code == 200
        assert me.json() == {"subject": "alice", "roles": {"acme": "admin", "beta": "developer"}}
