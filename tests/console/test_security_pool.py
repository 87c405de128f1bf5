"""Security CVM replicas (console/security_pool.py), on SQLite and PostgreSQL: each replica a CVM of
its own with its own enrolled credential, all serving their pool's Dev CVMs, records attributed
to the replica that shipped them; tokens that expired or were reused are refused and audited."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx

from tests.console import enroll
from tests.console.helpers import Team, traffic_record, unique
from umbra.console.enrollment import CvmEnrollment, token_digest
from umbra.console.models import utcnow


def register(team: Team, replica: int) -> dict[str, Any]:
    response = team.admin.post(
        f"/api/v1/teams/{team.name}/security-replicas/{replica}/enrollment-token"
    )
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def audit(team: Team) -> list[tuple[str, str, dict[str, Any]]]:
    page = team.admin.get(f"/api/v1/teams/{team.name}/audit", params={"limit": 200}).json()
    entries = page["entries"] if isinstance(page, dict) else page
    return [(e["action"], e["target"], e.get("details", {})) for e in entries]


def test_each_replica_enrolls_as_its_own_cvm_and_serves_the_pool(
    team: Team, tmp_path: Path
) -> None:
    first, second = register(team, 0), register(team, 1)
    assert first["created"] and second["created"]
    pool = first["cvm_id"]
    assert first["pool_id"] == second["pool_id"] == pool != second["cvm_id"]
    again = register(team, 1)  # idempotent per replica: same record, a fresh token
    assert (again["cvm_id"], again["created"]) == (second["cvm_id"], False)
    assert again["token"] != second["token"]
    info = team.admin.get(f"/api/v1/cvms/{second['cvm_id']}").json()
    assert (info["kind"], info["provider"], info["replica_of"], info["replica_index"]) == (
        "security", "team-stack", pool, 1,
    )  # fmt: skip
    assert "token" not in str(info) and second["token"] not in str(info)
    # Registered, not booted: `pending` until it enrolls, never `running` (fails on the old code,
    # which showed every registered replica as running).
    assert info["state"] == "pending"

    creds = {
        r["cvm_id"]: enroll.enroll(
            team.server.url, team.admin, r["cvm_id"], enroll.SECURITY_IMAGE, tmp_path,
            token=r["token"],
        )
        for r in (first, again)
    }  # fmt: skip
    assert len(set(creds.values())) == 2  # one identity per replica
    for cvm_id in creds:  # enrolled after an attested boot: now it runs
        assert team.admin.get(f"/api/v1/cvms/{cvm_id}").json()["state"] == "running"
    clients = {cvm_id: team.server.client(c) for cvm_id, c in creds.items()}
    try:
        # Dev CVMs route to the pool, never to one replica.
        to_replica = team.dev.post(
            f"/api/v1/teams/{team.name}/cvms",
            json={"name": unique("d"), "security_cvm_id": second["cvm_id"]},
        )
        assert to_replica.status_code == 422 and "is a replica" in to_replica.text
        dev = team.dev.post(
            f"/api/v1/teams/{team.name}/cvms", json={"name": unique("d"), "security_cvm_id": pool}
        )
        assert dev.status_code == 201, dev.text
        dev_id = dev.json()["id"]
        for cvm_id, client in clients.items():
            doc = client.get(f"/api/v1/security-cvms/{cvm_id}/attachments")
            assert doc.status_code == 200 and dev_id in doc.json()["cvms"], doc.text
            other = next(c for c in clients if c != cvm_id)
            denied = client.get(f"/api/v1/security-cvms/{other}/attachments")
            assert denied.status_code == 403  # a replica speaks only for itself
            record = traffic_record(team.name, cvm_id=dev_id, owner=team.dev_subject)
            shipped = client.post("/api/v1/traffic/batches", json={"records": [record]})
            assert shipped.status_code == 200, shipped.text
        # The pool's developer's personal secret is in every replica's release, in no other's.
        put = team.dev.put(
            f"/api/v1/teams/{team.name}/personal-secrets/{unique('p')}",
            json={"value": "v", "hosts": ["example.com"]},
        )
        assert put.status_code == 200, put.text
        versions = {
            cvm_id: client.get(f"/api/v1/security-cvms/{cvm_id}/secrets/version").json()
            for cvm_id, client in clients.items()
        }
        assert len(set(map(str, versions.values()))) == 1
        outside = team.scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/secrets/version").json()
        assert outside != next(iter(versions.values()))
        page = team.admin.get(f"/api/v1/teams/{team.name}/traffic", params={"cvm_id": dev_id})
        rows = page.json()["records"]
        assert sorted(r["security_cvm_id"] for r in rows) == sorted(creds)

        actions = audit(team)
        for cvm_id in creds:
            assert ("cvm.enroll", cvm_id, {"kind": "security"}) in actions
        registered = [a for a in actions if a[0] == "cvm.register_replica"]
        assert sorted(a[2]["replica"] for a in registered) == [0, 1]

        # The team stack runs them: the Console starts, stops and resizes nothing.
        patched = team.admin.patch(f"/api/v1/cvms/{pool}", json={"state": "stopped"})
        assert patched.status_code == 409 and "team stack" in patched.text

        # The pool goes replica by replica; destroying one revokes only its credential.
        refused = team.admin.delete(f"/api/v1/cvms/{pool}")
        assert refused.status_code == 409 and second["cvm_id"] in refused.text
        assert team.admin.delete(f"/api/v1/cvms/{second['cvm_id']}").status_code == 200
        gone = clients[second["cvm_id"]].get(
            f"/api/v1/security-cvms/{second['cvm_id']}/attachments"
        )
        assert gone.status_code == 401
        assert clients[pool].get(f"/api/v1/security-cvms/{pool}/attachments").status_code == 200
        # The break-glass credential (no attestation) replaces the enrolled one, audited as such.
        assert team.admin.post(f"/api/v1/cvms/{pool}/credential").status_code == 200
        assert ("cvm.credential", pool, {"break_glass": True}) in audit(team)
        assert clients[pool].get(f"/api/v1/security-cvms/{pool}/attachments").status_code == 401
        assert team.admin.delete(f"/api/v1/cvms/{pool}").status_code == 200
    finally:
        for client in clients.values():
            client.close()


def _challenge(team: Team, token: str) -> httpx.Response:
    with team.server.client() as anonymous:
        return anonymous.post("/api/v1/enroll/challenge", json={"token": token})


def test_a_replica_booting_after_its_token_expired_fails_visibly_until_reissued(
    team: Team, tmp_path: Path
) -> None:
    minted = register(team, 0)
    with team.server.console.write() as session:  # the replica booted after TOKEN_TTL
        row = session.get(CvmEnrollment, token_digest(minted["token"]))
        assert row is not None
        row.expires_at = utcnow() - timedelta(seconds=1)
        session.add(row)
    late = _challenge(team, minted["token"])
    assert late.status_code == 403 and "expired_token" in late.text
    shown = team.admin.get(f"/api/v1/cvms/{minted['cvm_id']}").json()
    assert (shown["state"], shown["state_reason"]) == (
        "failed", "enrollment refused: expired_token",
    )  # fmt: skip
    actions = audit(team)
    assert ("cvm.enroll_refused", minted["cvm_id"], {"reason": "expired_token"}) in actions
    assert minted["token"] not in str(actions)

    # The operator re-issues (same record, new token) and the replica enrolls: running again.
    reissued = register(team, 0)
    assert (reissued["cvm_id"], reissued["created"]) == (minted["cvm_id"], False)
    enroll.enroll(
        team.server.url, team.admin, minted["cvm_id"], enroll.SECURITY_IMAGE, tmp_path,
        token=reissued["token"],
    )  # fmt: skip
    assert team.admin.get(f"/api/v1/cvms/{minted['cvm_id']}").json()["state"] == "running"

    # Its spent token, replayed: refused and audited; the enrolled replica stays running.
    replay = _challenge(team, reissued["token"])
    assert replay.status_code == 403 and "reused_token" in replay.text
    refusals = [(t, d["reason"]) for a, t, d in audit(team) if a == "cvm.enroll_refused"]
    assert (minted["cvm_id"], "reused_token") in refusals
    assert team.admin.get(f"/api/v1/cvms/{minted['cvm_id']}").json()["state"] == "running"


def test_replica_registration_is_admin_only_and_bounded(team: Team) -> None:
    url = f"/api/v1/teams/{team.name}/security-replicas/{{}}/enrollment-token"
    assert team.dev.post(url.format(0)).status_code == 403
    assert team.admin.post(url.format(8)).status_code == 422
    assert team.admin.post(url.format(-1)).status_code == 422
    assert team.admin.post(url.format("x")).status_code == 422


def test_the_cli_registers_a_replica_and_prints_what_the_team_stack_needs(
    server: Any, team: Team, tmp_path: Path
) -> None:
    from tests.console.test_cli_admin import Cli

    admin = Cli(tmp_path / "admin")
    token = str(team.admin.headers["Authorization"]).removeprefix("Bearer ")
    admin("auth", "login", server.url, "--token-file", "-", "--team", team.name, input=token)
    minted = admin.json("cvm", "security-replica", "1")
    assert (minted["replica"], minted["created"]) == (1, True)
    assert minted["cvm_id"] != minted["pool_id"] and minted["token"].startswith("enr_")
    piped = admin("cvm", "security-replica", "1", "--token-only").stdout
    assert piped.startswith("enr_") and piped.count("\n") == 1  # just the token, for a pipe
    shown = admin("cvm", "security-replica", "1").output
    assert minted["cvm_id"] in shown and "already registered" in shown
    assert f"'umbra:stack.security_cvm.cvm_ids[1]' {minted['cvm_id']}" in shown
    assert "pulumi config set --secret securityEnrollmentToken1" in shown

    dev = Cli(tmp_path / "dev")
    dev_token = str(team.dev.headers["Authorization"]).removeprefix("Bearer ")
    dev("auth", "login", server.url, "--token-file", "-", "--team", team.name, input=dev_token)
    refused = dev("cvm", "security-replica", "0", code=1)
    assert "403" in refused.output


def test_a_dev_cvm_is_routed_to_its_teams_pool_by_default(team: Team) -> None:
    assert team.admin.delete(f"/api/v1/cvms/{team.scvm_id}").status_code == 200
    pool = register(team, 0)["cvm_id"]
    register(team, 1)
    register(team, 2)
    created = team.dev.post(f"/api/v1/teams/{team.name}/cvms", json={"name": unique("d")})
    assert created.status_code == 201, created.text
    assert created.json()["security_cvm_id"] == pool  # the pool counts once, by replica 0
