"""cvm: Security CVM replicas, each its own enrolled identity in its team's pool

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 11:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("cvm") as batch:
        batch.add_column(sa.Column("replica_of", sa.String(length=40), nullable=True))
        batch.add_column(sa.Column("replica_index", sa.Integer(), nullable=True))
        batch.create_index("ix_cvm_replica_of", ["replica_of"])


def downgrade() -> None:
    with op.batch_alter_table("cvm") as batch:
        batch.drop_index("ix_cvm_replica_of")
        batch.drop_column("replica_index")
        batch.drop_column("replica_of")
