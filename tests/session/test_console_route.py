"""`GET /api/v1/cvms/{id}/session`: owner or team admin only; Dev CVMs only; recorded launch facts
served, invalid ones withheld (the client then refuses with `launch-data`)."""

from __future__ import annotations

from tests.console.helpers import Server, unique
from tests.console.oidc_issuer import LocalIssuer
from tests.session import harness
from umbra.console.models import Cvm


def test_session_route(console: Server, issuer: LocalIssuer) -> None:
    team = unique("team")
    owner = console.client(issuer.token(unique("dev"), [f"{team}:developer"]))
    other = console.client(issuer.token(unique("dev"), [f"{team}:developer"]))
    admin = console.client(issuer.token(unique("adm"), [f"{team}:admin"]))
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl k"
    made = owner.post(f"/api/v1/teams/{team}/cvms", json={"name": "main", "ssh_keys": [key]})
    assert made.status_code == 201, made.text
    cvm_id = made.json()["id"]
    url = f"/api/v1/cvms/{cvm_id}/session"
    bare = owner.get(url).json()
    assert bare["ingress"] is None and bare["release"] is None
    assert bare["ssh_authorized_keys"] == [" ".join(key.split()[:2])]
    with console.console.write() as session:
        cvm = session.get(Cvm, cvm_id)
        assert cvm is not None
        cvm.provider_state = {
            "ssh_ingress": {"host": "127.0.0.1", "port": 2222},
            "release_manifest": harness.release_manifest(),
        }
    for client in (owner, admin):
        doc = client.get(url).json()
        assert doc["ingress"] == {"host": "127.0.0.1", "port": 2222}
        assert doc["release"]["name"] == harness.IMAGE and doc["state"] == "running"
    assert other.get(url).status_code == 404  # another developer's CVM does not exist for them
    digest = "ab" * 32  # the host ruleset's digest the cloud provider recorded at launch
    with console.console.write() as session:
        cvm = session.get(Cvm, cvm_id)
        assert cvm is not None
        cvm.provider_state = {"expected_events": {"umbra.host-firewall": digest}}
    assert owner.get(url).json()["host_firewall_sha256"] == digest
    with console.console.write() as session:
        cvm = session.get(Cvm, cvm_id)
        assert cvm is not None
        cvm.provider_state = {"expected_events": {"umbra.host-firewall": "not hex"}}
    assert owner.get(url).json()["host_firewall_sha256"] is None  # withheld: the client refuses
    with console.console.write() as session:
        cvm = session.get(Cvm, cvm_id)
        assert cvm is not None
        cvm.provider_state = {"ssh_ingress": {"host": "bad host; rm", "port": 0}}
    assert owner.get(url).json()["ingress"] is None
    sec = admin.post(f"/api/v1/teams/{team}/cvms", json={"name": "sec", "kind": "security"})
    assert admin.get(f"/api/v1/cvms/{sec.json()['id']}/session").status_code == 422
    advertised = console.client().get("/api/v1/auth/oidc").json()
    assert advertised == {
        "issuer": issuer.url,
        "audience": "umbra-console",
        "client_id": "umbra-cli",
    }
    for client in (owner, other, admin):
        client.close()
