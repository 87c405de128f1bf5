"""disk quotas: each Dev CVM's data disk size, and the team's disk bounds and quotas

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 07:45:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TEAM = (
    "min_data_disk_gb",
    "max_data_disk_gb",
    "max_data_disk_gb_per_owner",
    "max_data_disk_gb_total",
)


def upgrade() -> None:
    # CVMs launched before this revision have no recorded size: they count 0 GB until resized.
    op.add_column("cvm", sa.Column("data_disk_gb", sa.Integer(), nullable=True))
    for column in _TEAM:
        op.add_column("team_settings", sa.Column(column, sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("team_settings") as batch:
        for column in _TEAM:
            batch.drop_column(column)
    with op.batch_alter_table("cvm") as batch:
        batch.drop_column("data_disk_gb")
