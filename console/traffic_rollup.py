"""Traffic rollups: counts per (team, owner, CVM, 30-minute slot), and denials per slot by host,
reason and rule, maintained in the transaction that inserts the records.

Only records actually inserted are counted (a shipper's retry adds nothing): on PostgreSQL the
insert's `RETURNING` feeds two additive upserts in the same statement; on SQLite (one writer, the
write gate) the batch's already-stored ids are looked up first. Upserts touch rows in key order,
so concurrent batches of one team never deadlock. The overview page reads slots for ranges whose
bucket width is a whole number of slots (24 h, 7 d, 30 d; their window starts at a slot
boundary), and the records themselves for 1 h and 6 h, which are small.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from umbra.contracts.traffic import Decision, TrafficRecord

SLOT_SECONDS = 1800
DIMENSIONS = ("host", "reason", "rule")
_PG_SLOT = f"(floor(extract(epoch FROM i.time) / {SLOT_SECONDS}) * {SLOT_SECONDS})::bigint"


def pg_insert_with_rollups(insert_sql: str) -> str:
    """Wrap the bulk `INSERT ... ON CONFLICT DO NOTHING` so the one statement also adds the
    inserted records to the rollups and returns how many were inserted."""
    return (
        f"WITH i AS ({insert_sql} RETURNING team, owner, cvm_id, time, decision, host, reason, "  # noqa: S608 (constants)
        "rule_id), "
        "s AS (INSERT INTO traffic_slot AS t (team, owner, cvm_id, slot, total, denied) "
        f"SELECT i.team, coalesce(i.owner, ''), coalesce(i.cvm_id, ''), {_PG_SLOT}, count(*), "
        f"count(*) FILTER (WHERE i.decision = '{Decision.DENY.value}') FROM i "
        "GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4 "
        "ON CONFLICT (team, owner, cvm_id, slot) DO UPDATE "
        "SET total = t.total + excluded.total, denied = t.denied + excluded.denied), "
        "d AS (INSERT INTO traffic_slot_denial AS t "
        "(team, owner, cvm_id, slot, dimension, value, count) "
        f"SELECT i.team, coalesce(i.owner, ''), coalesce(i.cvm_id, ''), {_PG_SLOT}, v.dimension, "
        "coalesce(v.value, ''), count(*) FROM i CROSS JOIN LATERAL (VALUES ('host', i.host), "
        "('reason', i.reason), ('rule', i.rule_id)) AS v(dimension, value) "
        f"WHERE i.decision = '{Decision.DENY.value}' "
        "GROUP BY 1, 2, 3, 4, 5, 6 ORDER BY 1, 2, 3, 4, 5, 6 "
        "ON CONFLICT (team, owner, cvm_id, slot, dimension, value) DO UPDATE "
        "SET count = t.count + excluded.count) "
        "SELECT count(*) FROM i"
    )


def slot_of(epoch_seconds: float) -> int:
    return int(epoch_seconds) // SLOT_SECONDS * SLOT_SECONDS


def sqlite_stored_ids(cursor: Any, records: Sequence[TrafficRecord]) -> set[tuple[str, str, str]]:
    """(team, id, stored time) of the batch's records already stored (before the insert): the
    table's key (revision 0015)."""
    stored: set[tuple[str, str, str]] = set()
    keys = sorted({(r.team or "", str(r.id), sqlite_time(r.time)) for r in records})
    for start in range(0, len(keys), 300):
        chunk = keys[start : start + 300]
        clause = " OR ".join("(team = ? AND id = ? AND time = ?)" for _ in chunk)
        cursor.execute(
            f"SELECT team, id, time FROM traffic_record WHERE {clause}",  # noqa: S608 (placeholders)
            [value for key in chunk for value in key],
        )
        stored.update((str(t), str(i), str(when)) for t, i, when in cursor.fetchall())
    return stored


def sqlite_time(value: datetime) -> str:
    """SQLAlchemy's SQLite DATETIME storage format, so comparisons compare like with like."""
    return (
        f"{value.year:04d}-{value.month:02d}-{value.day:02d} "
        f"{value.hour:02d}:{value.minute:02d}:{value.second:02d}.{value.microsecond:06d}"
    )


def sqlite_add(cursor: Any, inserted: Iterable[TrafficRecord]) -> None:
    """Add records that were just inserted to the rollups (SQLite)."""
    slots: Counter[tuple[str, str, str, int]] = Counter()
    denied: Counter[tuple[str, str, str, int]] = Counter()
    denials: Counter[tuple[str, str, str, int, str, str]] = Counter()
    for record in inserted:
        key = (
            record.team or "",
            record.owner or "",
            record.cvm_id or "",
            slot_of(record.time.timestamp()),
        )
        slots[key] += 1
        if record.decision == Decision.DENY:
            denied[key] += 1
            for dimension, value in zip(
                DIMENSIONS, (record.host, record.reason, record.rule_id), strict=True
            ):
                denials[(*key, dimension, value or "")] += 1
    cursor.executemany(
        "INSERT INTO traffic_slot (team, owner, cvm_id, slot, total, denied) "
        "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (team, owner, cvm_id, slot) DO UPDATE "
        "SET total = total + excluded.total, denied = denied + excluded.denied",
        [(*key, count, denied[key]) for key, count in sorted(slots.items())],
    )
    cursor.executemany(
        "INSERT INTO traffic_slot_denial (team, owner, cvm_id, slot, dimension, value, count) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (team, owner, cvm_id, slot, dimension, value) DO UPDATE "
        "SET count = count + excluded.count",
        [(*key, count) for key, count in sorted(denials.items())],
    )


# What a deleted record's RETURNING gives, slot computed by the database (both dialects).
DELETED_COLUMNS = (
    "team, coalesce(owner, ''), coalesce(cvm_id, ''), {slot}, decision, host, reason, rule_id"
)
PG_SLOT_OF_TIME = f"(floor(extract(epoch FROM time) / {SLOT_SECONDS}) * {SLOT_SECONDS})::bigint"
SQLITE_SLOT_OF_TIME = f"(CAST(strftime('%s', time) AS INTEGER) / {SLOT_SECONDS} * {SLOT_SECONDS})"


def subtract(connection: Any, deleted: Iterable[Sequence[Any]]) -> None:
    """Take records that were just deleted (rows of `DELETED_COLUMNS`) out of the rollups, in the
    deleting transaction, so the overview never counts a record retention removed. Rows are
    touched in key order, like the ingest's upserts (no deadlock with a concurrent batch); a slot
    or denial row that reaches zero is deleted. `connection`: a SQLAlchemy Connection/Session."""
    from sqlalchemy import text

    slots: Counter[tuple[str, str, str, int]] = Counter()
    denied: Counter[tuple[str, str, str, int]] = Counter()
    denials: Counter[tuple[str, str, str, int, str, str]] = Counter()
    for team, owner, cvm_id, slot, decision, host, reason, rule_id in deleted:
        key = (str(team), str(owner), str(cvm_id), int(slot))
        slots[key] += 1
        if decision == Decision.DENY.value:
            denied[key] += 1
            for dimension, value in zip(DIMENSIONS, (host, reason, rule_id), strict=True):
                denials[(*key, dimension, value or "")] += 1
    where = "team = :team AND owner = :owner AND cvm_id = :cvm AND slot = :slot"
    slot_rows = [
        {"team": k[0], "owner": k[1], "cvm": k[2], "slot": k[3], "n": n, "d": denied[k]}
        for k, n in sorted(slots.items())
    ]
    denial_rows = [
        {"team": k[0], "owner": k[1], "cvm": k[2], "slot": k[3], "dim": k[4], "value": k[5], "n": n}
        for k, n in sorted(denials.items())
    ]
    if slot_rows:
        connection.execute(
            text(f"UPDATE traffic_slot SET total = total - :n, denied = denied - :d WHERE {where}"),  # noqa: S608
            slot_rows,
        )
        connection.execute(
            text(f"DELETE FROM traffic_slot WHERE {where} AND total <= 0"),  # noqa: S608
            [{k: row[k] for k in ("team", "owner", "cvm", "slot")} for row in slot_rows],
        )
    if denial_rows:
        match = f"{where} AND dimension = :dim AND value = :value"
        connection.execute(
            text(f"UPDATE traffic_slot_denial SET count = count - :n WHERE {match}"),  # noqa: S608
            denial_rows,
        )
        connection.execute(
            text(f"DELETE FROM traffic_slot_denial WHERE {match} AND count <= 0"),  # noqa: S608
            [{k: v for k, v in row.items() if k != "n"} for row in denial_rows],
        )
