"""The audit log: an append-only, hash-chained list of admin actions.

`hash = SHA-256(prev_hash ‖ canonical JSON of the entry)`, starting from 64 zeros. Sequence numbers
are assigned as head+1 under a primary key, and `prev_hash` is unique, so two concurrent appends can
never both attach to the same head: the loser retries on the new head. Editing, deleting or
reordering entries breaks the chain; rewriting the whole chain is detected by comparing the head with
a copy kept elsewhere (`audit-verify --expect-head`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console.db import as_utc
from umbra.console.models import AuditEntry, utcnow

GENESIS = "0" * 64
AUDIT_LOCK_KEY = 0x756D627261  # 'umbra'


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
    body = json.dumps(
        {
            "seq": seq,
            "time": as_utc(time).isoformat(timespec="microseconds"),
            "actor": actor,
            "team": team,
            "action": action,
            "target": target,
            "details": details,
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()
    return hashlib.sha256(bytes.fromhex(prev_hash) + body).hexdigest()


def append(
    session: Session, *, actor: str, team: str, action: str, target: str, details: dict[str, Any]
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
    return entry


@dataclass(frozen=True)
class ChainReport:
    ok: bool
    entries: int
    head: str
    problem: str | None = None
    bad_seq: int | None = None
    anchor_found: bool = False


def verify_chain(entries: Iterable[AuditEntry], anchor: str | None = None) -> ChainReport:
    """Recompute the chain. `anchor` is a head recorded earlier: `anchor_found` says whether the
    chain still passes through it (it will not if entries up to it were removed or rewritten)."""
    prev = GENESIS
    found = anchor == GENESIS
    expected_seq = 1
    count = 0
    for entry in entries:
        if entry.seq != expected_seq:
            return ChainReport(False, count, prev, f"expected seq {expected_seq}", entry.seq)
        if entry.prev_hash != prev:
            return ChainReport(False, count, prev, "prev_hash does not match", entry.seq)
        recomputed = entry_hash(
            prev,
            entry.seq,
            entry.time,
            entry.actor,
            entry.team,
            entry.action,
            entry.target,
            entry.details,
        )
        if recomputed != entry.hash:
            return ChainReport(
                False, count, prev, "entry content does not match its hash", entry.seq
            )
        prev = entry.hash
        found = found or entry.hash == anchor
        expected_seq += 1
        count += 1
    return ChainReport(True, count, prev, anchor_found=found)


def verify_database(session: Session, anchor: str | None = None, batch: int = 1000) -> ChainReport:
    def stream() -> Iterable[AuditEntry]:
        last = 0
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

    return verify_chain(stream(), anchor)
