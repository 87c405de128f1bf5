"""The audit log: an append-only, hash-chained list of admin actions.

`hash = SHA-256(prev_hash ‖ canonical JSON of the entry)`, starting from 64 zeros. Sequence numbers
are assigned as head+1 under a primary key, and `prev_hash` is unique, so two concurrent appends can
never both attach to the same head: the loser retries on the new head. Editing, deleting or
reordering entries breaks the chain; rewriting the whole chain is detected by comparing the head with
a copy kept elsewhere (`audit-verify --expect-head`).

Views verify incrementally: `audit_checkpoint` records how far the chain is known good, and a view
verifies only the entries after it (checking first that the checkpoint's entry still has the hash
it recorded), then moves it forward. Entries before the checkpoint are re-verified by the full path
(`umbra console audit-verify`, `verify_full`), which rewrites the checkpoint, a broken result
included, so that every later view reports the chain BROKEN until a full verification passes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console.db import as_utc
from umbra.console.enums import AuditAction
from umbra.console.models import AuditCheckpoint, AuditEntry, utcnow
from umbra.contracts.canonical import canonical_json

GENESIS = "0" * 64
CHECKPOINT_ID = 1
AUDIT_LOCK_KEY = 0x756D627261  # 'umbra'
_APPENDED = "umbra.audit.appended"


def entry_hash(
    prev_hash: str,
    seq: int,
    time: datetime,
    actor: str,
    team: str,
    action: str,
    target: str,
    details: dict[str, Any],
) -> str:
    body = canonical_json(
        {
            "seq": seq,
            "time": as_utc(time).isoformat(timespec="microseconds"),
            "actor": actor,
            "team": team,
            "action": action,
            "target": target,
            "details": details,
        }
    )
    return hashlib.sha256(bytes.fromhex(prev_hash) + body).hexdigest()


def append(
    session: Session,
    *,
    actor: str,
    team: str,
    action: AuditAction,
    target: str,
    details: dict[str, Any],
) -> AuditEntry:
    """Add an entry in the session's transaction, so the action and its record commit together.

    On PostgreSQL a transaction-scoped advisory lock serializes appenders; on SQLite the Console's
    write gate does. Should either be bypassed, the primary key and the unique `prev_hash` make the
    losing transaction fail instead of forking the chain.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": AUDIT_LOCK_KEY})
    head = session.execute(
        select(col(AuditEntry.seq), col(AuditEntry.hash))
        .order_by(col(AuditEntry.seq).desc())
        .limit(1)
    ).first()
    seq, prev = (head[0] + 1, head[1]) if head else (1, GENESIS)
    now = utcnow()
    entry = AuditEntry(
        seq=seq,
        time=now,
        actor=actor,
        team=team,
        action=action,
        target=target,
        details=details,
        prev_hash=prev,
        hash=entry_hash(prev, seq, now, actor, team, action, target, details),
    )
    session.add(entry)
    session.flush()
    session.info[_APPENDED] = session.info.get(_APPENDED, 0) + 1
    return entry


def take_appended(session: Session) -> int:
    """How many entries `append` added in this session since the last call (the Console counts
    them once their transaction commits: `umbra_console_audit_entries`)."""
    count: int = session.info.pop(_APPENDED, 0)
    return count


@dataclass(frozen=True)
class ChainReport:
    ok: bool
    entries: int
    head: str
    problem: str | None = None
    bad_seq: int | None = None
    anchor_found: bool = False
    from_seq: int = 0  # verified from the entry after this one (0: the whole chain)
    full_at: datetime | None = None  # when a full verification last covered the start


def _recompute(entry: AuditEntry, prev: str | None = None) -> str:
    """The entry's hash from its content, linked to `prev` (default: its stored `prev_hash`)."""
    return entry_hash(
        entry.prev_hash if prev is None else prev,
        entry.seq,
        entry.time,
        entry.actor,
        entry.team,
        entry.action,
        entry.target,
        entry.details,
    )


def verify_chain(
    entries: Iterable[AuditEntry], anchor: str | None = None, start: tuple[int, str] | None = None
) -> ChainReport:
    """Recompute the chain. `anchor` is a head recorded earlier: `anchor_found` says whether the
    chain still passes through it (it will not if entries up to it were removed or rewritten).
    `start` (seq, hash) continues from a verified entry: `entries` are the ones after it."""
    first, prev = start if start is not None else (0, GENESIS)
    found = anchor == prev
    expected_seq = first + 1
    count = first
    for entry in entries:
        if entry.seq != expected_seq:
            return ChainReport(False, count, prev, f"expected seq {expected_seq}", entry.seq)
        if entry.prev_hash != prev:
            return ChainReport(False, count, prev, "prev_hash does not match", entry.seq)
        if _recompute(entry, prev) != entry.hash:
            return ChainReport(
                False, count, prev, "entry content does not match its hash", entry.seq
            )
        prev = entry.hash
        found = found or entry.hash == anchor
        expected_seq += 1
        count += 1
    return ChainReport(True, count, prev, anchor_found=found, from_seq=first)


def verify_database(
    session: Session,
    anchor: str | None = None,
    batch: int = 1000,
    start: tuple[int, str] | None = None,
) -> ChainReport:
    def stream() -> Iterable[AuditEntry]:
        last = start[0] if start is not None else 0
        while True:
            rows = (
                session.execute(
                    select(AuditEntry)
                    .where(col(AuditEntry.seq) > last)
                    .order_by(col(AuditEntry.seq))
                    .limit(batch)
                )
                .scalars()
                .all()
            )
            if not rows:
                return
            yield from rows
            last = rows[-1].seq
            for row in rows:  # a long chain is streamed, not kept in the session
                session.expunge(row)

    return verify_chain(stream(), anchor, start)


def verify_incremental(session: Session) -> ChainReport:
    """What a view shows: the entries after the checkpoint, O(new entries). Fails closed: a
    checkpoint whose entry no longer has the recorded hash, or a broken result recorded by the
    last full verification, is reported as broken."""
    mark = session.get(AuditCheckpoint, CHECKPOINT_ID)
    if mark is None:
        return verify_database(session)
    if not mark.ok:
        return ChainReport(
            False, mark.seq, mark.hash, mark.problem, mark.bad_seq, full_at=mark.full_at
        )
    if mark.seq > 0:
        # The checkpoint's own entry is recomputed: its content must still give the recorded hash.
        at = session.get(AuditEntry, mark.seq)
        if at is None or at.hash != mark.hash or _recompute(at) != mark.hash:
            problem = "the entry at the verified checkpoint was changed or removed"
            return ChainReport(False, mark.seq - 1, mark.hash, problem, mark.seq)
    report = verify_database(session, start=(mark.seq, mark.hash))
    return replace(report, full_at=mark.full_at)


def save_checkpoint(session: Session, report: ChainReport, *, full: bool) -> None:
    """Record a verification in the session's transaction. A full one is recorded whatever its
    result; an incremental one only moves a good checkpoint forward (never back, never over a
    broken result). The migration creates the row; should two writers still both insert it, the
    loser's flush raises IntegrityError."""
    now = utcnow()
    mark = session.get(AuditCheckpoint, CHECKPOINT_ID, with_for_update=True)
    stale = mark is not None and (not mark.ok or mark.seq >= report.entries)
    if not full and (not report.ok or stale):
        return
    if mark is None:
        mark = AuditCheckpoint(id=CHECKPOINT_ID, seq=0, hash=GENESIS, updated_at=now)
        session.add(mark)
    mark.seq, mark.hash, mark.updated_at = report.entries, report.head, now
    mark.ok, mark.problem, mark.bad_seq = report.ok, report.problem, report.bad_seq
    if full:
        mark.full_at = now
    session.flush()


def verify_full(session: Session, anchor: str | None = None) -> ChainReport:
    """The whole chain from genesis; the result becomes the checkpoint (committed here)."""
    report = verify_database(session, anchor)
    try:
        save_checkpoint(session, report, full=True)
        session.commit()
    except IntegrityError:  # a concurrent first view inserted the row: update it instead
        session.rollback()
        save_checkpoint(session, report, full=True)
        session.commit()
    return replace(report, full_at=utcnow())
