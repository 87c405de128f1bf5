"""traffic record kind and detail

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 15:03:33.469295
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("traffic_record", schema=None) as batch_op:
        # Rows stored before this revision were all HTTP decisions.
        batch_op.add_column(
            sa.Column("kind", sa.String(length=16), nullable=False, server_default="http")
        )
        batch_op.add_column(sa.Column("detail", sa.String(length=1024), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("traffic_record", schema=None) as batch_op:
        batch_op.drop_column("detail")
        batch_op.drop_column("kind")
