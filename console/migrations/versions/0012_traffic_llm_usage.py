"""traffic records carry the LLM usage an API reported (model, input/output/cache tokens)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 05:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
# main's head when written; the lead rechains it at merge
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TOKENS = (
    "llm_input_tokens",
    "llm_output_tokens",
    "llm_cache_read_tokens",
    "llm_cache_write_tokens",
)


def upgrade() -> None:
    # nullable columns: a plain ADD COLUMN on both engines (no table rebuild)
    op.add_column("traffic_record", sa.Column("llm_model", sa.String(length=128), nullable=True))
    for name in _TOKENS:
        op.add_column("traffic_record", sa.Column(name, sa.BigInteger(), nullable=True))
    # usage pages sum per team and day: only the rows that carry usage are indexed
    op.create_index(
        "ix_traffic_team_llm_time",
        "traffic_record",
        ["team", "time"],
        postgresql_where=sa.text("llm_model IS NOT NULL"),
        sqlite_where=sa.text("llm_model IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_traffic_team_llm_time", table_name="traffic_record")
    with op.batch_alter_table("traffic_record") as batch:
        for name in (*reversed(_TOKENS), "llm_model"):
            batch.drop_column(name)
