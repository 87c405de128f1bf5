"""console scale: shared keys (stateless enrollment nonces), traffic rollups (overview),
deactivated users, team quotas

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 05:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# Frozen copies, as migrations must not change with the code (traffic_rollup.py at this revision).
SLOT = 1800
_PG_SLOT = f"(floor(extract(epoch FROM i.time) / {SLOT}) * {SLOT})::bigint"
_SQLITE_SLOT = f"(CAST(strftime('%s', i.time) AS INTEGER) / {SLOT} * {SLOT})"
PG_BACKFILL = (
    "INSERT INTO traffic_slot (team, owner, cvm_id, slot, total, denied) "  # noqa: S608 (constants)
    f"SELECT i.team, coalesce(i.owner, ''), coalesce(i.cvm_id, ''), {_PG_SLOT}, count(*), "
    "count(*) FILTER (WHERE i.decision = 'deny') FROM traffic_record i GROUP BY 1, 2, 3, 4",
    "INSERT INTO traffic_slot_denial (team, owner, cvm_id, slot, dimension, value, count) "  # noqa: S608
    f"SELECT i.team, coalesce(i.owner, ''), coalesce(i.cvm_id, ''), {_PG_SLOT}, v.dimension, "
    "coalesce(v.value, ''), count(*) FROM traffic_record i CROSS JOIN LATERAL (VALUES "
    "('host', i.host), ('reason', i.reason), ('rule', i.rule_id)) AS v(dimension, value) "
    "WHERE i.decision = 'deny' GROUP BY 1, 2, 3, 4, 5, 6",
)
SQLITE_BACKFILL = (
    "INSERT INTO traffic_slot (team, owner, cvm_id, slot, total, denied) "  # noqa: S608
    f"SELECT i.team, coalesce(i.owner, ''), coalesce(i.cvm_id, ''), {_SQLITE_SLOT}, count(*), "
    "sum(i.decision = 'deny') FROM traffic_record i GROUP BY 1, 2, 3, 4",
    *(
        "INSERT INTO traffic_slot_denial (team, owner, cvm_id, slot, dimension, value, count) "  # noqa: S608
        f"SELECT i.team, coalesce(i.owner, ''), coalesce(i.cvm_id, ''), {_SQLITE_SLOT}, "
        f"'{dimension}', coalesce(i.{column}, ''), count(*) FROM traffic_record i "
        "WHERE i.decision = 'deny' GROUP BY 1, 2, 3, 4, 5, 6"
        for dimension, column in (("host", "host"), ("reason", "reason"), ("rule", "rule_id"))
    ),
)

revision: str = "0011"
down_revision: str | None = "0010"
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
    for name, extra in (
        ("traffic_slot", [sa.Column("total", sa.BigInteger(), nullable=False),
                          sa.Column("denied", sa.BigInteger(), nullable=False)]),
        ("traffic_slot_denial", [sa.Column("dimension", sa.String(length=8), nullable=False),
                                 sa.Column("value", sa.String(length=260), nullable=False),
                                 sa.Column("count", sa.BigInteger(), nullable=False)]),
    ):  # fmt: skip
        key = ["team", "owner", "cvm_id", "slot"]
        if name == "traffic_slot_denial":
            key += ["dimension", "value"]
        op.create_table(
            name,
            sa.Column("team", sa.String(length=64), nullable=False),
            sa.Column("owner", sa.String(length=255), nullable=False),
            sa.Column("cvm_id", sa.String(length=40), nullable=False),
            sa.Column("slot", sa.BigInteger(), nullable=False),
            *extra,
            sa.PrimaryKeyConstraint(*key),
        )
    op.create_index("ix_traffic_slot_team_slot", "traffic_slot", ["team", "slot"])
    op.create_index(
        "ix_traffic_slot_denial_team_slot", "traffic_slot_denial", ["team", "dimension", "slot"]
    )
    op.create_table(
        "deactivated_user",
        sa.Column("team", sa.String(length=64), nullable=False),
        sa.Column("subject", sa.String(length=255), nullable=False),
        sa.Column("deactivated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deactivated_by", sa.String(length=255), nullable=False),
        sa.PrimaryKeyConstraint("team", "subject"),
    )
    op.create_index(
        op.f("ix_deactivated_user_subject"), "deactivated_user", ["subject"], unique=False
    )
    with op.batch_alter_table("team_settings") as batch:
        batch.add_column(sa.Column("max_dev_cvms_per_owner", sa.Integer(), nullable=True))
        batch.add_column(
            sa.Column("machine_types", sa.JSON(), nullable=False, server_default=sa.text("'[]'"))
        )
    # Records stored before this revision: the same aggregation the ingest does.
    backfill = PG_BACKFILL if op.get_bind().dialect.name == "postgresql" else SQLITE_BACKFILL
    for statement in backfill:
        op.execute(statement)
    # Enrollment nonces are signed, not stored (console/enrollment.py).
    with op.batch_alter_table("cvm_enrollment") as batch:
        batch.drop_column("nonce_expires_at")
        batch.drop_column("nonce")


def downgrade() -> None:
    with op.batch_alter_table("team_settings") as batch:
        batch.drop_column("machine_types")
        batch.drop_column("max_dev_cvms_per_owner")
    op.drop_index(op.f("ix_deactivated_user_subject"), table_name="deactivated_user")
    op.drop_table("deactivated_user")
    with op.batch_alter_table("cvm_enrollment") as batch:
        batch.add_column(sa.Column("nonce", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("nonce_expires_at", sa.DateTime(timezone=True), nullable=True))
    op.drop_table("console_key")
    op.drop_index("ix_traffic_slot_denial_team_slot", table_name="traffic_slot_denial")
    op.drop_table("traffic_slot_denial")
    op.drop_index("ix_traffic_slot_team_slot", table_name="traffic_slot")
    op.drop_table("traffic_slot")
