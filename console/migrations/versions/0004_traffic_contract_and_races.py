"""traffic contract limits, quarantine, per-team idempotency, per-owner CVM names, query indexes

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 05:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_INDEXES = (
    ("ix_traffic_cvm_time", ["cvm_id", "time"]),
    ("ix_traffic_host_time", ["host", "time"]),
    ("ix_traffic_owner_time", ["owner", "time"]),
)
_NEW_INDEXES = (
    ("ix_traffic_team_cvm_time", ["team", "cvm_id", "time"]),
    ("ix_traffic_team_owner_time", ["team", "owner", "time"]),
    ("ix_traffic_team_host_time", ["team", "host", "time"]),
    ("ix_traffic_team_decision_time", ["team", "decision", "time"]),
    ("ix_traffic_team_reason_time", ["team", "reason", "time"]),
    ("ix_traffic_team_rule_time", ["team", "rule_id", "time"]),
)
_WIDER = (
    ("method", 16, 32),
    ("connect_host", 255, 260),
    ("sni", 255, 260),
    ("host", 255, 260),
    ("pinned_ip", 45, 64),
    ("path", 2048, 8192),
)


def _postgresql() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    if _postgresql():
        op.drop_constraint("traffic_record_pkey", "traffic_record", type_="primary")
    with op.batch_alter_table("traffic_record", schema=None, recreate="auto") as batch_op:
        for name, old, new in _WIDER:
            batch_op.alter_column(
                name, existing_type=sa.String(length=old), type_=sa.String(length=new)
            )
        batch_op.add_column(sa.Column("truncated", sa.JSON(), nullable=False, server_default="[]"))
        for name, _columns in _OLD_INDEXES:
            batch_op.drop_index(name)
        for name, columns in _NEW_INDEXES:
            batch_op.create_index(name, columns, unique=False)
        batch_op.create_primary_key("traffic_record_pkey", ["team", "id"])

    op.create_table(
        "traffic_quarantine",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("team", sa.String(length=64), nullable=False),
        sa.Column("security_cvm_id", sa.String(length=40), nullable=False),
        sa.Column("record_id", sa.String(length=64), nullable=True),
        sa.Column("reason", sa.String(length=32), nullable=False),
        sa.Column("detail", sa.String(length=1024), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("excerpt", sa.String(length=2048), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("team", "fingerprint", name="uq_traffic_quarantine_fingerprint"),
    )
    op.create_index(
        "ix_traffic_quarantine_team_time", "traffic_quarantine", ["team", "received_at"]
    )

    with op.batch_alter_table("cvm", schema=None) as batch_op:
        batch_op.drop_constraint("uq_cvm_team_name", type_="unique")
        batch_op.create_unique_constraint("uq_cvm_team_owner_name", ["team", "owner", "name"])


def downgrade() -> None:
    # Fails (unique violation) if two owners share a CVM name or two teams a record id: that data
    # cannot be represented by revision 0003.
    with op.batch_alter_table("cvm", schema=None) as batch_op:
        batch_op.drop_constraint("uq_cvm_team_owner_name", type_="unique")
        batch_op.create_unique_constraint("uq_cvm_team_name", ["team", "name"])

    op.drop_index("ix_traffic_quarantine_team_time", table_name="traffic_quarantine")
    op.drop_table("traffic_quarantine")

    if _postgresql():
        op.drop_constraint("traffic_record_pkey", "traffic_record", type_="primary")
    with op.batch_alter_table("traffic_record", schema=None, recreate="auto") as batch_op:
        batch_op.create_primary_key("traffic_record_pkey", ["id"])
        for name, _columns in _NEW_INDEXES:
            batch_op.drop_index(name)
        for name, columns in _OLD_INDEXES:
            batch_op.create_index(name, columns, unique=False)
        batch_op.drop_column("truncated")
        for name, old, new in _WIDER:
            batch_op.alter_column(
                name, existing_type=sa.String(length=new), type_=sa.String(length=old)
            )
