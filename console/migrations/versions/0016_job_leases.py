"""job leases: the replica running a CVM's provider job (`cvm.lease_owner`, `cvm.lease_until`),
and an index on `cvm.state` for the takeover's scan of transitional rows

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 08:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Rows transitional at upgrade time have no lease: any replica may claim them (as a restart's
    # reconcile did before).
    with op.batch_alter_table("cvm") as batch:
        batch.add_column(sa.Column("lease_owner", sa.String(length=96), nullable=True))
        batch.add_column(sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))
    op.create_index(op.f("ix_cvm_state"), "cvm", ["state"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_cvm_state"), table_name="cvm")
    with op.batch_alter_table("cvm") as batch:
        batch.drop_column("lease_until")
        batch.drop_column("lease_owner")
