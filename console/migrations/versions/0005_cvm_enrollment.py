"""one-time enrollment tokens: a booted CVM trades one, with a quote, for its credential

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 05:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "cvm_enrollment",
        sa.Column("token_sha256", sa.String(length=64), nullable=False),
        sa.Column("cvm_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("nonce", sa.String(length=64), nullable=True),
        sa.Column("nonce_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("token_sha256"),
    )
    op.create_index("ix_cvm_enrollment_cvm_id", "cvm_enrollment", ["cvm_id"])


def downgrade() -> None:
    op.drop_index("ix_cvm_enrollment_cvm_id", table_name="cvm_enrollment")
    op.drop_table("cvm_enrollment")
