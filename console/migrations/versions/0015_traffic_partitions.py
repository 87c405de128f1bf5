"""traffic_record: primary key (team, id, time); PostgreSQL: range-partitioned by day on `time`

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 08:00:00.000000

PostgreSQL: the table is rebuilt as a partitioned table in the migration's one transaction (the
old one renamed, every row copied with its `export_seq`, the old one dropped), so no row is lost
and the SIEM export cursor and the overview's rollups stay valid as they are. Daily partitions
cover the stored records (the last `BACKFILL_DAYS` days of them; anything older, or newer than
the days created ahead, lands in the DEFAULT partition) and the next days. The sequence behind
`export_seq` is kept (re-owned by the new column). SQLite: no partitions, the key gains `time`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SEQ = "traffic_record_export_seq"
_OLD = "traffic_record_unpartitioned"
DEFAULT_PARTITION = "traffic_record_default"
AHEAD_DAYS = 2  # as console/traffic_partitions.AHEAD_DAYS when written
BACKFILL_DAYS = 400  # the retention setting's upper bound
_INDEXES: tuple[tuple[str, list[str]], ...] = (
    ("ix_traffic_team_time", ["team", "time", "id"]),
    ("ix_traffic_team_cvm_time", ["team", "cvm_id", "time"]),
    ("ix_traffic_team_owner_time", ["team", "owner", "time"]),
    ("ix_traffic_team_host_time", ["team", "host", "time"]),
    ("ix_traffic_team_decision_time", ["team", "decision", "time"]),
    ("ix_traffic_team_reason_time", ["team", "reason", "time"]),
    ("ix_traffic_team_rule_time", ["team", "rule_id", "time"]),
)
_LLM_INDEX = "ix_traffic_team_llm_time"
_SEQ_INDEX = "ix_traffic_record_export_seq"


def _partition_sql(day: date) -> str:
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    end = start + timedelta(days=1)
    return (
        f"CREATE TABLE traffic_record_p{day:%Y%m%d} PARTITION OF traffic_record "
        f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
    )


def _drop_indexes(table: str) -> None:
    for name, _columns in _INDEXES:
        op.drop_index(name, table_name=table)
    op.drop_index(_LLM_INDEX, table_name=table)
    op.drop_index(_SEQ_INDEX, table_name=table)


def _create_indexes() -> None:
    for name, columns in _INDEXES:
        op.create_index(name, "traffic_record", columns)
    op.create_index(
        _LLM_INDEX,
        "traffic_record",
        ["team", "time"],
        postgresql_where=sa.text("llm_model IS NOT NULL"),
        sqlite_where=sa.text("llm_model IS NOT NULL"),
    )
    op.create_index(_SEQ_INDEX, "traffic_record", ["export_seq"])


def _swap_table(partitioned: bool) -> None:
    """Rename the table away, make the new one (same columns, defaults and order), copy every row,
    drop the old one. Indexes are built after the copy (faster than maintaining them row by row)."""
    bind = op.get_bind()
    op.execute(f"ALTER SEQUENCE {_SEQ} OWNED BY NONE")  # else dropping the old table drops it
    op.execute(f"ALTER TABLE traffic_record RENAME TO {_OLD}")
    op.execute(f"ALTER TABLE {_OLD} DROP CONSTRAINT traffic_record_pkey")
    _drop_indexes(_OLD)
    by_range = " PARTITION BY RANGE (time)" if partitioned else ""
    op.execute(f"CREATE TABLE traffic_record (LIKE {_OLD} INCLUDING DEFAULTS){by_range}")
    if partitioned:
        op.execute(f"CREATE TABLE {DEFAULT_PARTITION} PARTITION OF traffic_record DEFAULT")
        today = datetime.now(UTC).date()
        since = datetime.combine(today - timedelta(days=BACKFILL_DAYS), datetime.min.time(), UTC)
        oldest = bind.execute(
            sa.text(f"SELECT min(time) FROM {_OLD} WHERE time >= :since"),  # noqa: S608
            {"since": since},
        ).scalar()
        first = today if oldest is None else min(oldest.astimezone(UTC).date(), today)
        day = first
        while day <= today + timedelta(days=AHEAD_DAYS):
            op.execute(_partition_sql(day))
            day += timedelta(days=1)
    op.execute(f"INSERT INTO traffic_record SELECT * FROM {_OLD}")  # noqa: S608 (constants)
    op.execute(f"DROP TABLE {_OLD}")
    key = "team, id, time" if partitioned else "team, id"
    op.execute(f"ALTER TABLE traffic_record ADD CONSTRAINT traffic_record_pkey PRIMARY KEY ({key})")
    _create_indexes()
    op.execute(f"ALTER SEQUENCE {_SEQ} OWNED BY traffic_record.export_seq")
    op.execute("ANALYZE traffic_record")


def upgrade() -> None:
    # retention deletes a dropped day's rollup rows for every team at once
    op.create_index("ix_traffic_slot_slot", "traffic_slot", ["slot"])
    op.create_index("ix_traffic_slot_denial_slot", "traffic_slot_denial", ["slot"])
    if op.get_bind().dialect.name == "postgresql":
        _swap_table(partitioned=True)
        return
    with op.batch_alter_table("traffic_record", recreate="always") as batch:
        batch.create_primary_key("traffic_record_pkey", ["team", "id", "time"])


def downgrade() -> None:
    op.drop_index("ix_traffic_slot_denial_slot", table_name="traffic_slot_denial")
    op.drop_index("ix_traffic_slot_slot", table_name="traffic_slot")
    if op.get_bind().dialect.name == "postgresql":
        # Two records that differ only in time cannot both stay under (team, id): fail, naming it.
        duplicate = (
            op.get_bind()
            .execute(
                sa.text(
                    "SELECT team, id FROM traffic_record GROUP BY team, id HAVING count(*) > 1 "
                    "LIMIT 1"
                )
            )
            .first()
        )
        if duplicate is not None:
            raise RuntimeError(
                f"cannot downgrade: team {duplicate[0]!r} has two traffic records with id "
                f"{duplicate[1]!r} (different times); delete one first"
            )
        _swap_table(partitioned=False)
        return
    with op.batch_alter_table("traffic_record", recreate="always") as batch:
        batch.create_primary_key("traffic_record_pkey", ["team", "id"])
