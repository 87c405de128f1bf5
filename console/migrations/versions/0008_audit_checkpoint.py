"""audit checkpoint: how far the hash chain is verified, so the audit page verifies only what follows

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 11:45:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_checkpoint",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("problem", sa.String(length=255), nullable=True),
        sa.Column("bad_seq", sa.Integer(), nullable=True),
        sa.Column("full_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    # The one row, at genesis: the first view verifies everything and moves it forward.
    op.execute(
        sa.text(
            "INSERT INTO audit_checkpoint (id, seq, hash, ok, updated_at) "
            "VALUES (1, 0, :genesis, true, CURRENT_TIMESTAMP)"
        ).bindparams(genesis="0" * 64)
    )


def downgrade() -> None:
    op.drop_table("audit_checkpoint")
