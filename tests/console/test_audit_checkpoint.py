"""The audit page verifies incrementally: only the entries after the checkpoint, which it then
moves forward. Tampering after the checkpoint (or with its own entry) is caught by the next view;
tampering before it is caught by the full `audit-verify`, whose broken result every view then
reports until a full verification passes again. Runs on SQLite and PostgreSQL (`server`)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import sqlalchemy
from sqlalchemy.orm import Session

from tests.console.helpers import Server, Team
from tests.console.test_audit import _verify
from umbra.console import audit
from umbra.console.audit import ChainReport
from umbra.console.models import AuditCheckpoint
from umbra.console.services.access import User
from umbra.console.web import queries


def _view(server: Server, team: Team) -> ChainReport:
    """What the audit page shows (its service function, as the route calls it)."""
    admin = User(subject="auditor@test", roles={team.name: "admin"})
    return queries.audit_page(server.console, admin, team.name, None).chain


def _act(team: Team, name: str) -> None:
    done = team.admin.put(f"/api/v1/teams/{team.name}/secrets/{name}", json={"value": "v"})
    assert done.status_code == 200, done.text


def _checkpoint(server: Server) -> AuditCheckpoint:
    with Session(server.console.engine) as session:
        mark = session.get(AuditCheckpoint, audit.CHECKPOINT_ID)
        assert mark is not None  # the migration creates it
        return mark


@contextmanager
def _tampered(server: Server, seq: int) -> Iterator[None]:
    """Edit one entry's actor behind the Console's back (a database writer), then restore it."""
    engine = server.console.engine
    with engine.begin() as connection:
        original = connection.execute(
            sqlalchemy.text("SELECT actor FROM audit_entry WHERE seq = :seq"), {"seq": seq}
        ).scalar_one()
        connection.execute(
            sqlalchemy.text("UPDATE audit_entry SET actor = 'mallory' WHERE seq = :seq"),
            {"seq": seq},
        )
    try:
        yield
    finally:
        with engine.begin() as connection:
            connection.execute(
                sqlalchemy.text("UPDATE audit_entry SET actor = :actor WHERE seq = :seq"),
                {"seq": seq, "actor": original},
            )


def test_a_view_verifies_only_the_entries_after_the_checkpoint(server: Server, team: Team) -> None:
    _act(team, "cp-a")
    first = _view(server, team)
    assert first.ok, first
    assert _checkpoint(server).seq == first.entries and _checkpoint(server).hash == first.head
    _act(team, "cp-b")
    _act(team, "cp-c")
    second = _view(server, team)
    assert second.ok and second.from_seq == first.entries
    assert second.entries == first.entries + 2
    assert _checkpoint(server).seq == second.entries
    again = _view(server, team)  # nothing new: nothing to verify, nothing written
    assert again.ok and again.from_seq == again.entries == second.entries


def test_tampering_after_the_checkpoint_or_with_its_entry_is_caught_by_the_next_view(
    server: Server, team: Team
) -> None:
    _act(team, "cp-d")
    verified = _view(server, team)
    _act(team, "cp-e")
    newest = verified.entries + 1
    with _tampered(server, newest):
        broken = _view(server, team)
        assert not broken.ok and broken.bad_seq == newest
        assert "does not match its hash" in (broken.problem or "")
        assert _checkpoint(server).seq == verified.entries  # a broken view moves nothing
    with _tampered(server, verified.entries):  # the checkpoint's own entry
        broken = _view(server, team)
        assert not broken.ok and broken.bad_seq == verified.entries
    assert _view(server, team).ok


def test_tampering_before_the_checkpoint_is_caught_by_the_full_check_and_then_every_view(
    server: Server, team: Team
) -> None:
    _act(team, "cp-f")
    _act(team, "cp-g")
    verified = _view(server, team)
    old = verified.entries - 1  # already behind the checkpoint
    with _tampered(server, old):
        # A view does not re-read what was verified (that is what makes it O(new entries)).
        assert _view(server, team).ok
        code, output = _verify(server)
        assert code == 1 and f"seq {old}" in output
        broken = _view(server, team)
        assert not broken.ok and broken.bad_seq == old and broken.full_at is not None
        _act(team, "cp-h")  # new entries do not clear a broken full verification
        assert not _view(server, team).ok
    assert not _view(server, team).ok  # repaired, but only a full verification says so
    code, output = _verify(server)
    assert code == 0, output
    assert _view(server, team).ok


def test_concurrent_views_and_appends_leave_the_checkpoint_at_a_verified_entry(
    server: Server, team: Team
) -> None:
    def view(_index: int) -> bool:
        return _view(server, team).ok

    def act(index: int) -> None:
        _act(team, f"cp-par-{index}")

    with ThreadPoolExecutor(max_workers=8) as pool:
        acts = [pool.submit(act, i) for i in range(8)]
        views = list(pool.map(view, range(16)))
        for done in acts:
            done.result()
    assert all(views)
    final = _view(server, team)
    assert final.ok
    mark = _checkpoint(server)
    assert mark.ok and mark.seq == final.entries and mark.hash == final.head
    with Session(server.console.engine) as session:
        full = audit.verify_database(session)
    assert full.ok and full.head == final.head
