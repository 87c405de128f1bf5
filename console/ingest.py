"""Traffic ingest: validate each shipped record on its own, store the good, quarantine the rest.

One record never blocks a batch (a shipper that is refused retries forever, and nothing after the
refused batch would ever be stored). The fast path validates the whole batch from bytes in one
pass; only a batch with a bad record falls back to record-by-record validation, and each record
that still fails, names another team, or names a Dev CVM not in the team is quarantined with the
reason (visible to admins in `umbra logs --quarantined`). Only a body that is not a batch at all
is refused (422): that is a broken shipper, not a record.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console.enums import CvmKind
from umbra.console.models import Cvm, utcnow
from umbra.console.traffic_store import insert_quarantined, insert_records
from umbra.contracts.traffic import (
    QuarantineReason,
    TrafficBatch,
    TrafficRecord,
    ValidBatch,
    describe,
)

EXCERPT_CHARS = 2048
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class BatchRejected(Exception):
    """The body is not a traffic batch; the message names where, never the submitted values."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("not a traffic batch")
        self.errors = errors


@dataclass(frozen=True)
class IngestOutcome:
    received: int
    inserted: int
    duplicates: int
    quarantined: int


@dataclass(frozen=True)
class _Quarantine:
    raw: object
    reason: QuarantineReason
    detail: str


def parse(raw: bytes) -> tuple[list[TrafficRecord], list[_Quarantine], int]:
    """Good records, quarantined ones, and how many were received."""
    try:
        batch = ValidBatch.model_validate_json(raw)
        return batch.records, [], len(batch.records)
    except ValidationError:
        pass
    try:
        loose = TrafficBatch.model_validate_json(raw)
    except ValidationError as exc:
        raise BatchRejected(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_input=False)]
        ) from None
    good: list[TrafficRecord] = []
    bad: list[_Quarantine] = []
    for item in loose.records:
        try:
            good.append(TrafficRecord.model_validate(item))
        except ValidationError as exc:
            bad.append(_Quarantine(item, QuarantineReason.INVALID, describe(exc)))
    return good, bad, len(loose.records)


def ingest(
    session: Session, raw: bytes, team: str, security_cvm_id: str, max_records: int
) -> IngestOutcome:
    """Runs inside the caller's write transaction."""
    good, bad, received = parse(raw)
    if received > max_records:
        raise BatchRejected(
            [
                {
                    "loc": ("body", "records"),
                    "msg": f"at most {max_records} records per batch",
                    "type": "too_long",
                }
            ]
        )
    unique: dict[uuid.UUID, TrafficRecord] = {}
    for record in good:
        if record.team is None:
            record.team = team
        if record.team != team:
            bad.append(
                _Quarantine(
                    record.wire(),
                    QuarantineReason.FOREIGN_TEAM,
                    "team: not this Security CVM's team",
                )
            )
            continue
        unique.setdefault(record.id, record)
    cvm_ids = {record.cvm_id for record in unique.values() if record.cvm_id is not None}
    if cvm_ids:
        known = set(
            session.execute(
                select(col(Cvm.id)).where(
                    col(Cvm.id).in_(cvm_ids), col(Cvm.team) == team, col(Cvm.kind) == CvmKind.dev
                )
            ).scalars()
        )
        for record_id, record in list(unique.items()):
            if record.cvm_id is not None and record.cvm_id not in known:
                del unique[record_id]
                bad.append(
                    _Quarantine(
                        record.wire(),
                        QuarantineReason.UNKNOWN_CVM,
                        f"cvm_id: no Dev CVM {record.cvm_id} in this team",
                    )
                )
    now = utcnow()
    inserted = insert_records(session, list(unique.values()), security_cvm_id, now)
    # A retry quarantines nothing new; the count reported is this batch's.
    insert_quarantined(session, [_row(item, team, security_cvm_id, now) for item in bad])
    return IngestOutcome(
        received=received,
        inserted=inserted,
        duplicates=received - inserted - len(bad),
        quarantined=len(bad),
    )


def _row(item: _Quarantine, team: str, scvm: str, now: datetime) -> dict[str, Any]:
    text = json.dumps(item.raw, sort_keys=True, separators=(",", ":"), default=str)
    record_id = item.raw.get("id") if isinstance(item.raw, dict) else None
    return {
        "team": team,
        "security_cvm_id": scvm,
        "record_id": _CONTROL.sub("?", str(record_id))[:64]
        if isinstance(record_id, str | int)
        else None,
        "reason": item.reason.value,
        "detail": _CONTROL.sub("?", item.detail)[:1024],
        "fingerprint": hashlib.sha256(text.encode()).hexdigest(),
        "excerpt": text[:EXCERPT_CHARS],
        "received_at": now,
    }
