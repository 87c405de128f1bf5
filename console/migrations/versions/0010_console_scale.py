"""console scale: shared keys (stateless enrollment nonces)

Revision ID: 0010_console_scale
Revises: 0009
Create Date: 2026-12-06 05:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_console_scale"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "console_key",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("secret", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    # Enrollment nonces are signed, not stored (console/enrollment.py).
    with op.batch_alter_table("cvm_enrollment") as batch:
        batch.drop_column("nonce_expires_at")
        batch.drop_column("nonce")


def downgrade() -> None:
    with op.batch_alter_table("cvm_enrollment") as batch:
        batch.add_column(sa.Column("nonce", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("nonce_expires_at", sa.DateTime(timezone=True), nullable=True))
    op.drop_table("console_key")
