"""The audit log: every admin action appended, hash chained, tampering detected by audit-verify."""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from tests.console.helpers import Server, Team
from umbra.cli.app import app as umbra_app
from umbra.console import audit
from umbra.console.enums import AuditAction
from umbra.console.models import AuditEntry


def test_admin_actions_are_audited_in_order(team: Team) -> None:
    base = f"/api/v1/teams/{team.name}"
    info = team.upload(1).json()
    cvm = team.dev_cvm()
    team.admin.put(f"/api/v1/cvms/{cvm}/profiles", json={"profiles": ["github"]})
    team.admin.put(f"{base}/secrets/bot", json={"value": "audit-secret-value"})
    team.dev.put(f"{base}/personal-secrets/gh", json={"value": "v", "hosts": ["github.com"]})
    team.admin.delete(f"/api/v1/cvms/{cvm}")
    page = team.admin.get(f"{base}/audit").json()
    actions = [(entry["action"], entry["target"]) for entry in page["entries"]]
    assert actions == [
        ("cvm.launch", team.scvm_id),
        ("cvm.enrollment_token", team.scvm_id),  # the team's Security CVM enrolled
        ("cvm.enroll", team.scvm_id),
        ("policy.upload", info["hash"]),
        ("cvm.launch", cvm),
        ("cvm.enrollment_token", cvm),  # its launch data's one-time token
        ("profiles.attach", cvm),
        ("secret.set", "team/bot"),
        ("secret.set", "personal/gh"),
        ("cvm.destroy", cvm),
    ]
    actors = [entry["actor"] for entry in page["entries"]]
    assert actors[4] == team.dev_subject and actors[8] == team.dev_subject
    assert all("audit-secret-value" not in str(entry) for entry in page["entries"])
    seqs = [entry["seq"] for entry in page["entries"]]
    assert seqs == sorted(seqs)


def _verify(server: Server, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        umbra_app,
        ["console", "audit-verify", "--database-url", server.settings.database_url, *extra],
    )
    return result.exit_code, " ".join(result.output.split())


def test_verify_detects_tampering(server: Server, team: Team) -> None:
    team.upload(1)
    team.admin.put(f"/api/v1/teams/{team.name}/secrets/a", json={"value": "v"})
    code, output = _verify(server)
    assert code == 0, output
    assert "audit chain OK" in output
    head = output.split("head ")[1].split()[0]
    assert _verify(server, "--expect-head", head)[0] == 0

    engine = server.console.engine
    with Session(engine) as session:
        report = audit.verify_database(session)
        assert report.ok and report.head == head
    target = report.entries  # the newest entry
    with engine.begin() as connection:
        original = connection.execute(
            sqlalchemy.text("SELECT actor FROM audit_entry WHERE seq = :seq"), {"seq": target}
        ).scalar_one()
        connection.execute(
            sqlalchemy.text("UPDATE audit_entry SET actor = 'mallory' WHERE seq = :seq"),
            {"seq": target},
        )
    try:
        code, output = _verify(server)
        assert code == 1
        assert f"seq {target}" in output
        assert "does not match its hash" in output
    finally:
        with engine.begin() as connection:
            connection.execute(
                sqlalchemy.text("UPDATE audit_entry SET actor = :actor WHERE seq = :seq"),
                {"seq": target, "actor": original},
            )
    assert _verify(server)[0] == 0
    # Later actions extend the chain: the recorded head is still passed through.
    team.admin.put(f"/api/v1/teams/{team.name}/secrets/b", json={"value": "v"})
    assert _verify(server, "--expect-head", head)[0] == 0
    code, output = _verify(server, "--expect-head", "ab" * 32)
    assert code == 1
    assert "does not contain the recorded head" in output


def test_truncation_is_caught_by_a_recorded_head() -> None:
    entries = _chain(3)
    assert audit.verify_chain(entries, anchor=entries[2].hash).anchor_found
    truncated = audit.verify_chain(entries[:2], anchor=entries[2].hash)
    assert truncated.ok and not truncated.anchor_found


def _chain(length: int) -> list[AuditEntry]:
    entries = []
    prev = audit.GENESIS
    for seq in range(1, length + 1):
        when = datetime(2026, 1, 1, tzinfo=UTC)
        digest = audit.entry_hash(prev, seq, when, "a", "t", "x", "y", {"n": seq})
        fields = {"actor": "a", "team": "t", "action": "x", "target": "y", "details": {"n": seq}}
        entries.append(AuditEntry(seq=seq, time=when, prev_hash=prev, hash=digest, **fields))
        prev = digest
    return entries


def test_chain_detects_deleted_entries() -> None:
    entries = _chain(3)
    assert audit.verify_chain(entries).ok
    report = audit.verify_chain([entries[0], entries[2]])
    assert not report.ok and report.bad_seq == 3


def test_concurrent_admin_actions_keep_one_chain(server: Server, team: Team) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    headers = dict(team.admin.headers)

    def set_secret(index: int) -> int:
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
            url = f"/api/v1/teams/{team.name}/secrets/c{index}"
            return client.put(url, json={"value": "v"}).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = list(pool.map(set_secret, range(24)))
    assert statuses == [200] * 24
    with Session(server.console.engine) as session:
        report = audit.verify_database(session)
    assert report.ok, report
    targets = [
        entry["target"]
        for entry in team.admin.get(
            f"/api/v1/teams/{team.name}/audit", params={"limit": 1000}
        ).json()["entries"]
        if entry["action"] == "secret.set"
    ]
    assert sorted(targets) == sorted(f"team/c{index}" for index in range(24))


def test_every_committed_audit_entry_is_counted_once(server: Server, team: Team) -> None:
    """`umbra_console_audit_entries` counts every entry `audit.append` adds once its transaction
    commits, wherever it was appended (it was bumped at 3 of 18 sites: a launch, an attachment or
    a destroy went uncounted); a rolled-back append is not counted. Fails on the old code."""
    counter = server.console.metrics.audit_entries
    before = counter._value.get()
    with Session(server.console.engine) as session:
        start = session.query(AuditEntry).count()
    team.upload(1)
    cvm = team.dev_cvm()
    team.admin.put(f"/api/v1/cvms/{cvm}/profiles", json={"profiles": ["github"]})
    team.admin.put(f"/api/v1/teams/{team.name}/secrets/bot", json={"value": "v"})
    team.admin.delete(f"/api/v1/cvms/{cvm}")
    with server.console.write() as session:
        audit.append(session, actor="t", team=team.name, action=AuditAction.cvm_update,
                     target=cvm, details={})  # fmt: skip
    try:
        with server.console.write() as session:
            audit.append(session, actor="t", team=team.name, action=AuditAction.cvm_update,
                         target=cvm, details={})  # fmt: skip
            raise RuntimeError("roll back")
    except RuntimeError:
        pass
    with Session(server.console.engine) as session:
        added = session.query(AuditEntry).count() - start
    assert added >= 6
    assert counter._value.get() - before == added
