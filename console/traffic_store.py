"""Bulk, idempotent storage of traffic records: the fast path behind `POST /traffic/batches`.

PostgreSQL: the validated batch goes to the server as one JSON document and is expanded there by
`json_populate_recordset` into a single `INSERT ... ON CONFLICT (team, id, time) DO NOTHING` (no per-row
Python work). SQLite: one `executemany` of `INSERT OR IGNORE`. Either way a record already
stored (same team, id and time: a retry re-sends all three) is skipped, so shipper retries never
duplicate, and the number actually inserted comes back.
The same statement (PostgreSQL) or transaction (SQLite) adds the inserted records to the
overview's rollups (traffic_rollup.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pydantic import TypeAdapter
from sqlalchemy.orm import Session

from umbra.console import traffic_rollup
from umbra.contracts.traffic import TrafficRecord

# The contract's fields, in its order: one definition (tests/console/test_traffic_fields.py ties
# the table and the API's response model to it).
RECORD_COLUMNS = tuple(TrafficRecord.model_fields)
COLUMNS = (*RECORD_COLUMNS, "security_cvm_id", "received_at")
JSON_COLUMNS = frozenset({"query_keys", "scan_rule_ids", "injected_headers", "truncated"})
RECORDS = TypeAdapter(list[TrafficRecord])

_COLUMN_LIST = ", ".join(COLUMNS)
_PG_INSERT = (
    f"INSERT INTO traffic_record ({_COLUMN_LIST}) "  # noqa: S608 (constant names, no input)
    f"SELECT {', '.join('r.' + c for c in RECORD_COLUMNS)}, %(scvm)s, %(now)s "
    "FROM json_populate_recordset(NULL::traffic_record, %(doc)s::json) AS r "
    "ON CONFLICT (team, id, time) DO NOTHING"
)
_PG_INSERT_WITH_ROLLUPS = traffic_rollup.pg_insert_with_rollups(_PG_INSERT)
_SQLITE_INSERT = (
    f"INSERT OR IGNORE INTO traffic_record ({_COLUMN_LIST}) "  # noqa: S608
    f"VALUES ({', '.join('?' for _ in COLUMNS)})"
)
QUARANTINE_CHUNK = 500
EXPORT_HORIZON_LOCK = 0x756D62726145  # 'umbraE'
_dumps = json.JSONEncoder(separators=(",", ":")).encode


_sqlite_time = traffic_rollup.sqlite_time


def insert_records(
    session: Session,
    records: Sequence[TrafficRecord],
    security_cvm_id: str,
    received_at: datetime,
) -> int:
    """Insert validated records (times already UTC) unless their id exists; return how many were
    inserted. Runs inside the session's transaction."""
    if not records:
        return 0
    dbapi = session.connection().connection.driver_connection
    if session.get_bind().dialect.name == "postgresql":
        return _insert_postgresql(dbapi, records, security_cvm_id, received_at)
    return _insert_sqlite(dbapi, records, security_cvm_id, received_at)


def _insert_postgresql(
    connection: Any, records: Sequence[TrafficRecord], scvm: str, now: datetime
) -> int:
    document = RECORDS.dump_json(list(records)).decode()
    with connection.cursor() as cursor:
        # Shared with every other ingest; the exporter takes it exclusively for an instant to read
        # an `export_seq` horizon no in-flight insert can still fall below (console/export).
        cursor.execute("SELECT pg_advisory_xact_lock_shared(%s)", (EXPORT_HORIZON_LOCK,))
        cursor.execute(_PG_INSERT_WITH_ROLLUPS, {"scvm": scvm, "now": now, "doc": document})
        row = cursor.fetchone()
        return int(row[0]) if row else 0


def _insert_sqlite(
    connection: Any, records: Sequence[TrafficRecord], scvm: str, now: datetime
) -> int:
    values = []
    received = _sqlite_time(now)
    for row in RECORDS.dump_python(list(records)):
        item: list[Any] = []
        for column in RECORD_COLUMNS:
            value = row[column]
            if column in JSON_COLUMNS:
                value = _dumps(value)
            elif column == "time":
                value = _sqlite_time(value)
            elif column == "id":
                value = str(value)
            elif column in ("kind", "decision"):
                value = str(value.value) if hasattr(value, "value") else value
            item.append(value)
        item.extend((scvm, received))
        values.append(item)
    cursor = connection.cursor()
    try:
        stored = traffic_rollup.sqlite_stored_ids(cursor, records)
        cursor.executemany(_SQLITE_INSERT, values)
        inserted = int(cursor.rowcount)
        fresh: dict[tuple[str, str, str], TrafficRecord] = {}
        for record in records:
            key = (record.team or "", str(record.id), _sqlite_time(record.time))
            if key not in stored:
                fresh.setdefault(key, record)
        traffic_rollup.sqlite_add(cursor, fresh.values())
        return inserted
    finally:
        cursor.close()


def insert_quarantined(session: Session, rows: Sequence[dict[str, Any]]) -> int:
    """Insert quarantine rows unless the same record (by fingerprint) is already quarantined for
    the team; return how many were new."""
    unique = list({row["fingerprint"]: row for row in rows}.values())
    if not unique:
        return 0
    from umbra.console.models import TrafficQuarantine

    table = TrafficQuarantine.__table__  # type: ignore[attr-defined]
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    inserted = 0
    # Chunks keep every statement under the drivers' bound-parameter limits (PostgreSQL: 65535).
    for start in range(0, len(unique), QUARANTINE_CHUNK):
        chunk = unique[start : start + QUARANTINE_CHUNK]
        statement: Any = insert(table).values(chunk).on_conflict_do_nothing()
        inserted += int(session.execute(statement).rowcount)  # type: ignore[attr-defined]
    return inserted
