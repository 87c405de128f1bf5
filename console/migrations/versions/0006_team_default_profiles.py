"""team settings: default profiles the Console attaches to every Dev CVM it launches

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 07:55:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "team_settings",
        sa.Column("team", sa.String(length=64), nullable=False),
        sa.Column("default_profiles", sa.JSON(), nullable=False),
        sa.Column("updated_by", sa.String(length=255), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("team"),
    )


def downgrade() -> None:
    op.drop_table("team_settings")
