"""cvm launch inputs, provider state, progress events and failure reason

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 15:25:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("cvm", schema=None) as batch_op:
        # Existing rows were launched by `local`, which has no inputs, state or events.
        batch_op.add_column(sa.Column("ssh_keys", sa.JSON(), nullable=False, server_default="[]"))
        batch_op.add_column(sa.Column("size", sa.String(length=64), nullable=True))
        batch_op.add_column(
            sa.Column("provider_state", sa.JSON(), nullable=False, server_default="{}")
        )
        batch_op.add_column(sa.Column("events", sa.JSON(), nullable=False, server_default="[]"))
        batch_op.add_column(sa.Column("state_reason", sa.String(length=512), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("cvm", schema=None) as batch_op:
        batch_op.drop_column("state_reason")
        batch_op.drop_column("events")
        batch_op.drop_column("provider_state")
        batch_op.drop_column("size")
        batch_op.drop_column("ssh_keys")
