"""SIEM export: traffic insertion order (`export_seq`) and per-sink cursors (`export_cursor`)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 06:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
# main's head when written; the lead rechains it at merge
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SEQ = "traffic_record_export_seq"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # Existing rows are numbered too (the default is evaluated per row: a table rewrite), so
        # an exporter configured later starts from the oldest stored record.
        op.execute(f"CREATE SEQUENCE {_SEQ}")
        op.add_column(
            "traffic_record",
            sa.Column(
                "export_seq",
                sa.BigInteger(),
                nullable=True,
                server_default=sa.text(f"nextval('{_SEQ}')"),
            ),
        )
        op.execute(f"ALTER SEQUENCE {_SEQ} OWNED BY traffic_record.export_seq")
    else:
        op.add_column("traffic_record", sa.Column("export_seq", sa.BigInteger(), nullable=True))
    op.create_index("ix_traffic_record_export_seq", "traffic_record", ["export_seq"])
    op.create_table(
        "export_cursor",
        sa.Column("sink", sa.String(length=16), nullable=False),
        sa.Column("stream", sa.String(length=16), nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sink", "stream"),
    )


def downgrade() -> None:
    op.drop_table("export_cursor")
    op.drop_index("ix_traffic_record_export_seq", table_name="traffic_record")
    with op.batch_alter_table("traffic_record") as batch:
        batch.drop_column("export_seq")  # PostgreSQL drops the owned sequence with it
