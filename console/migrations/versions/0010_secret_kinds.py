"""secret kinds: what a secret holds (static value or a minting/signing document), whether it
needs a new login, and the refresh lease that keeps one rotating refresh-token chain

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06 05:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("secret") as batch:
        # Every existing secret is a static value and usable as stored.
        batch.add_column(
            sa.Column("kind", sa.String(length=32), nullable=False, server_default="static")
        )
        batch.add_column(
            sa.Column("status", sa.String(length=16), nullable=False, server_default="ok")
        )
        batch.add_column(sa.Column("lease_id", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("lease_holder", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("secret") as batch:
        batch.drop_column("lease_until")
        batch.drop_column("lease_holder")
        batch.drop_column("lease_id")
        batch.drop_column("status")
        batch.drop_column("kind")
