"""launch bindings: what a CVM's token enrollment measured, so a reboot re-enrolls by quote

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 18:50:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "cvm_launch_binding",
        sa.Column("cvm_id", sa.String(length=64), nullable=False),
        sa.Column("events", sa.JSON(), nullable=False),
        sa.Column("events_sha256", sa.String(length=64), nullable=False),
        sa.Column("bound_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("renewals", sa.Integer(), nullable=False),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("nonce", sa.String(length=64), nullable=True),
        sa.Column("nonce_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("cvm_id"),
    )


def downgrade() -> None:
    op.drop_table("cvm_launch_binding")
