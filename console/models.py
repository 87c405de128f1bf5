"""The Console's tables (SQLModel). Alembic migrations under `migrations/` create exactly these.

Secret values never live here in plaintext: `Secret` holds AES-GCM ciphertext under a per-secret data
key, and that data key only wrapped under a key encryption key the database never sees.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Index,
    LargeBinary,
    Sequence,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator
from sqlmodel import AutoString, Field, SQLModel

from umbra.console.enums import AuditAction, CvmKind, CvmState, Scope, SecretStatus
from umbra.contracts.secret_kinds import SecretKind

EXPORT_SEQUENCE = "traffic_record_export_seq"


class EnumText[E: StrEnum](TypeDecorator[E]):
    """A StrEnum stored as its plain string (the column is the VARCHAR it always was, so no
    migration), read back as the enum."""

    impl = AutoString
    cache_ok = True

    def __init__(self, enum: type[E], length: int) -> None:
        super().__init__(length=length)
        self.enum = enum

    def process_bind_param(self, value: E | str | None, dialect: Dialect) -> str | None:
        return None if value is None else self.enum(value).value

    def process_result_value(self, value: str | None, dialect: Dialect) -> E | None:
        return None if value is None else self.enum(value)


def utcnow() -> datetime:
    return datetime.now(UTC)


def _ts(*, index: bool = False, nullable: bool = False) -> Any:
    return Field(
        default_factory=utcnow,
        sa_type=DateTime(timezone=True),
        index=index,
        nullable=nullable,
    )


class PolicyBundle(SQLModel, table=True):
    """A verified, signed policy bundle uploaded for one team; the highest serial is current."""

    __tablename__ = "policy_bundle"
    __table_args__ = (UniqueConstraint("team", "serial", name="uq_policy_bundle_team_serial"),)

    id: int | None = Field(default=None, primary_key=True)
    team: str = Field(index=True, max_length=64)
    serial: int = Field(sa_type=BigInteger)
    hash: str = Field(max_length=80)
    keyid: str = Field(max_length=80)
    source: str | None = Field(default=None, max_length=512)
    profiles: list[str] = Field(sa_column=Column(JSON, nullable=False))
    raw: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    uploaded_by: str = Field(max_length=255)
    created_at: datetime = _ts()


class TeamSettings(SQLModel, table=True):
    """Per-team settings an admin changes (revision 0006). No row means the defaults: no default
    profiles."""

    __tablename__ = "team_settings"

    team: str = Field(primary_key=True, max_length=64)
    # Attached by the Console to every Dev CVM it launches for the team, whatever the provider.
    default_profiles: list[str] = Field(
        default_factory=list, sa_column=Column(JSON, nullable=False)
    )
    # Quotas (revision 0011): Dev CVMs per developer (None: no limit), and the
    # machine types Dev CVMs may have (empty: whatever the provider accepts).
    max_dev_cvms_per_owner: int | None = None
    machine_types: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    # Data disks (revision 0016_disk_quotas; None: no limit): each Dev CVM's size within
    # [min, max], and the sum over a developer's and over the team's non-destroyed Dev CVMs.
    min_data_disk_gb: int | None = None
    max_data_disk_gb: int | None = None
    max_data_disk_gb_per_owner: int | None = None
    max_data_disk_gb_total: int | None = None
    updated_by: str = Field(max_length=255)
    updated_at: datetime = _ts()


class Cvm(SQLModel, table=True):
    """A confidential VM: a Dev CVM (runs sandboxes) or a Security CVM (runs the egress proxy)."""

    __tablename__ = "cvm"
    # Names are per owner: two developers may each have a CVM called `main` (revision 0004).
    __table_args__ = (UniqueConstraint("team", "owner", "name", name="uq_cvm_team_owner_name"),)

    id: str = Field(primary_key=True, max_length=40)
    team: str = Field(index=True, max_length=64)
    name: str = Field(max_length=64)
    kind: CvmKind = Field(sa_type=EnumText(CvmKind, 16))
    owner: str = Field(index=True, max_length=255)
    provider: str = Field(max_length=32)
    provider_ref: str | None = Field(default=None, max_length=255)
    # Indexed for the job takeover's scan of transitional rows (revision 0016).
    state: CvmState = Field(sa_type=EnumText(CvmState, 16), index=True)
    security_cvm_id: str | None = Field(default=None, index=True, max_length=40)
    # Security CVM replicas (revision 0007): each replica is its own CVM with its own enrolled
    # credential; `replica_of` names the pool's first Security CVM, the one Dev CVMs route to
    # (NULL for that one and for Dev CVMs). `replica_index` is the team stack's replica number
    # (0 for the pool's first), NULL for CVMs not registered by a team stack.
    replica_of: str | None = Field(default=None, index=True, max_length=40)
    replica_index: int | None = None
    profiles: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    credential_hash: str | None = Field(default=None, unique=True, max_length=64)
    # Launch inputs and what the provider reported (revision 0003). Public keys, not secrets.
    ssh_keys: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    size: str | None = Field(default=None, max_length=64)
    # The Dev CVM's data disk (GB, revision 0016_disk_quotas): asked at launch or the provider's
    # default; what the team's disk quotas count (None, from before 0016 or `local`: 0).
    data_disk_gb: int | None = None
    provider_state: dict[str, Any] = Field(
        default_factory=dict, sa_column=Column(JSON, nullable=False)
    )
    events: list[dict[str, Any]] = Field(
        default_factory=list, sa_column=Column(JSON, nullable=False)
    )
    state_reason: str | None = Field(default=None, max_length=512)
    created_by: str = Field(max_length=255)
    created_at: datetime = _ts()
    updated_at: datetime = _ts()
    # The replica running this CVM's provider job and until when (database time), PostgreSQL
    # (revision 0016, console/leases.py); NULL when no job runs or on SQLite.
    lease_owner: str | None = Field(default=None, max_length=96)
    lease_until: datetime | None = Field(
        default=None, sa_type=DateTime(timezone=True), nullable=True
    )


class Secret(SQLModel, table=True):
    """A write-only secret: team-wide, or personal to one owner and bound to hosts."""

    __tablename__ = "secret"
    __table_args__ = (
        UniqueConstraint("team", "scope", "owner", "name", name="uq_secret_identity"),
    )

    id: int | None = Field(default=None, primary_key=True)
    team: str = Field(index=True, max_length=64)
    scope: Scope = Field(sa_type=EnumText(Scope, 16))
    owner: str = Field(default="", max_length=255)  # "" for team secrets
    name: str = Field(max_length=128)
    hosts: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    version: int = 1
    kek_id: str = Field(max_length=64)
    wrapped_key: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    ciphertext: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    kind: SecretKind = Field(default=SecretKind.static, sa_type=EnumText(SecretKind, 32))
    status: SecretStatus = Field(default=SecretStatus.ok, sa_type=EnumText(SecretStatus, 16))
    # A Security CVM refreshing a rotating refresh token holds this lease (console/services/
    # secret_refresh.py): one refresher per chain across replicas.
    lease_id: str | None = Field(default=None, max_length=64)
    lease_holder: str | None = Field(default=None, max_length=64)
    lease_until: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    updated_by: str = Field(max_length=255)
    created_at: datetime = _ts()
    updated_at: datetime = _ts()


class ReleaseNonce(SQLModel, table=True):
    """A single-use challenge a Security CVM binds into its quote to receive secrets."""

    __tablename__ = "release_nonce"

    nonce: str = Field(primary_key=True, max_length=64)
    security_cvm_id: str = Field(index=True, max_length=40)
    expires_at: datetime = Field(sa_type=DateTime(timezone=True))
    used: bool = False


class DeactivatedUser(SQLModel, table=True):
    """A developer deactivated in a team (revision 0011): their tokens and web
    sessions carry no role in it from then on (services/people.py)."""

    __tablename__ = "deactivated_user"

    team: str = Field(primary_key=True, max_length=64)
    subject: str = Field(primary_key=True, max_length=255, index=True)
    deactivated_at: datetime = Field(sa_type=DateTime(timezone=True))
    deactivated_by: str = Field(max_length=255)


class ConsoleKey(SQLModel, table=True):
    """A key the Console's replicas share, created once by whichever starts first (revision
    0010): `enroll-nonce` signs stateless enrollment nonces (console/console_keys.py)."""

    __tablename__ = "console_key"

    name: str = Field(primary_key=True, max_length=64)
    secret: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    created_at: datetime = Field(sa_type=DateTime(timezone=True))


class TrafficSlot(SQLModel, table=True):
    """Traffic counts per team, owner, CVM and 30-minute slot, added in the transaction that
    inserts the records (revision 0011): the overview reads these, not the records
    (console/traffic_rollup.py). '' stands for a record without owner or CVM."""

    __tablename__ = "traffic_slot"
    # by slot alone (revision 0015): retention deletes a dropped day's slots for every team
    __table_args__ = (
        Index("ix_traffic_slot_team_slot", "team", "slot"),
        Index("ix_traffic_slot_slot", "slot"),
    )

    team: str = Field(primary_key=True, max_length=64)
    owner: str = Field(primary_key=True, max_length=255)
    cvm_id: str = Field(primary_key=True, max_length=40)
    slot: int = Field(primary_key=True, sa_type=BigInteger)  # epoch seconds, a slot's start
    total: int = Field(sa_type=BigInteger)
    denied: int = Field(sa_type=BigInteger)


class TrafficSlotDenial(SQLModel, table=True):
    """Denials per slot by host, reason and rule (`dimension`): the overview's top lists."""

    __tablename__ = "traffic_slot_denial"
    __table_args__ = (
        Index("ix_traffic_slot_denial_team_slot", "team", "dimension", "slot"),
        Index("ix_traffic_slot_denial_slot", "slot"),
    )

    team: str = Field(primary_key=True, max_length=64)
    owner: str = Field(primary_key=True, max_length=255)
    cvm_id: str = Field(primary_key=True, max_length=40)
    slot: int = Field(primary_key=True, sa_type=BigInteger)
    dimension: str = Field(primary_key=True, max_length=8)  # host | reason | rule
    value: str = Field(primary_key=True, max_length=260)  # '' for none
    count: int = Field(sa_type=BigInteger)


class TrafficRecord(SQLModel, table=True):
    """One proxy decision (`umbra.contracts.traffic.TrafficRecord`); never values or bodies.

    The record id is the shipper's idempotency key, scoped per team (revision 0004): one team's
    Security CVM cannot suppress another team's records by reusing their ids. The key includes
    `time` (revision 0015): PostgreSQL partitions the table by day on `time`, and a partitioned
    table's keys must hold its partition column; a shipper's retry re-sends the same time, so it is
    still skipped (console/traffic_partitions.py)."""

    __tablename__ = "traffic_record"
    # Every developer/dashboard query is per team, newest first, optionally filtered by one of
    # these columns (revision 0004).
    __table_args__ = (
        Index("ix_traffic_team_time", "team", "time", "id"),
        Index("ix_traffic_team_cvm_time", "team", "cvm_id", "time"),
        Index("ix_traffic_team_owner_time", "team", "owner", "time"),
        Index("ix_traffic_team_host_time", "team", "host", "time"),
        Index("ix_traffic_team_decision_time", "team", "decision", "time"),
        Index("ix_traffic_team_reason_time", "team", "reason", "time"),
        Index("ix_traffic_team_rule_time", "team", "rule_id", "time"),
        # rows with LLM usage only (revision 0012): usage sums per team and day
        Index(
            "ix_traffic_team_llm_time",
            "team",
            "time",
            postgresql_where=text("llm_model IS NOT NULL"),
            sqlite_where=text("llm_model IS NOT NULL"),
        ),
    )

    team: str = Field(primary_key=True, max_length=64)
    id: str = Field(primary_key=True, max_length=36)
    security_cvm_id: str = Field(max_length=40)
    time: datetime = Field(primary_key=True, sa_type=DateTime(timezone=True))
    cvm_id: str | None = Field(default=None, max_length=40)
    owner: str | None = Field(default=None, max_length=255)
    kind: str = Field(default="http", max_length=16)
    policy_hash: str | None = Field(default=None, max_length=80)
    method: str | None = Field(default=None, max_length=32)
    connect_host: str | None = Field(default=None, max_length=260)
    sni: str | None = Field(default=None, max_length=260)
    host: str | None = Field(default=None, max_length=260)
    port: int | None = None
    pinned_ip: str | None = Field(default=None, max_length=64)
    path: str | None = Field(default=None, max_length=8192)
    query_keys: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    decision: str = Field(max_length=16)
    rule_id: str | None = Field(default=None, max_length=160)
    reason: str | None = Field(default=None, max_length=64)
    status: int | None = None
    bytes_sent: int = Field(default=0, sa_type=BigInteger)
    bytes_received: int = Field(default=0, sa_type=BigInteger)
    duration_ms: float = 0.0
    scan_rule_ids: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    injected_headers: list[str] = Field(
        default_factory=list, sa_column=Column(JSON, nullable=False)
    )
    detail: str | None = Field(default=None, max_length=1024)
    # LLM usage (revision 0012); summed by `services/usage.py`
    llm_model: str | None = Field(default=None, max_length=128)
    llm_input_tokens: int | None = Field(default=None, sa_type=BigInteger)
    llm_output_tokens: int | None = Field(default=None, sa_type=BigInteger)
    llm_cache_read_tokens: int | None = Field(default=None, sa_type=BigInteger)
    llm_cache_write_tokens: int | None = Field(default=None, sa_type=BigInteger)
    truncated: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    received_at: datetime = _ts()
    # Insertion order for the SIEM export (revision 0013, console/export): PostgreSQL fills it
    # from a sequence; SQLite leaves it NULL and the exporter reads `rowid` (writes are serial).
    export_seq: int | None = Field(
        default=None,
        sa_column=Column(BigInteger, Sequence(EXPORT_SEQUENCE), nullable=True, index=True),
    )


class ExportCursor(SQLModel, table=True):
    """How far one export sink has been acknowledged, per stream (revision 0013): `position` is
    the last `traffic_record.export_seq` (SQLite: rowid) or `audit_entry.seq` its receiver took."""

    __tablename__ = "export_cursor"

    sink: str = Field(primary_key=True, max_length=16)  # otlp | syslog
    stream: str = Field(primary_key=True, max_length=16)  # traffic | audit
    position: int = Field(default=0, sa_type=BigInteger)
    updated_at: datetime = _ts()


class TrafficQuarantine(SQLModel, table=True):
    """A shipped record the Console could not store, kept with the reason instead of blocking the
    batch. `fingerprint` (SHA-256 of the record as received) makes shipper retries idempotent;
    `excerpt` is the start of the record as received, already redacted by the proxy."""

    __tablename__ = "traffic_quarantine"
    __table_args__ = (
        UniqueConstraint("team", "fingerprint", name="uq_traffic_quarantine_fingerprint"),
        Index("ix_traffic_quarantine_team_time", "team", "received_at"),
    )

    id: int | None = Field(default=None, primary_key=True)
    team: str = Field(max_length=64)
    security_cvm_id: str = Field(max_length=40)
    record_id: str | None = Field(default=None, max_length=64)
    reason: str = Field(max_length=32)  # umbra.contracts.traffic.QuarantineReason
    detail: str = Field(max_length=1024)
    fingerprint: str = Field(max_length=64)
    excerpt: str = Field(max_length=2048)
    received_at: datetime = _ts()


class AuditEntry(SQLModel, table=True):
    """One admin action; `hash` chains over the previous entry's hash, so edits are detectable."""

    __tablename__ = "audit_entry"

    seq: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    time: datetime = Field(sa_type=DateTime(timezone=True))
    actor: str = Field(max_length=255)
    team: str = Field(index=True, max_length=64)
    action: AuditAction = Field(sa_type=EnumText(AuditAction, 64))
    target: str = Field(max_length=255)
    details: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    prev_hash: str = Field(max_length=64, unique=True)
    hash: str = Field(max_length=64)


class AuditCheckpoint(SQLModel, table=True):
    """How far the audit chain is known good (one row, id 1): the audit page verifies only the
    entries after it. A full verification (`umbra console audit-verify`) rewrites it, and records
    a broken chain here too, so every view says BROKEN until a full verification passes again."""

    __tablename__ = "audit_checkpoint"

    id: int = Field(default=1, primary_key=True, sa_column_kwargs={"autoincrement": False})
    seq: int  # the last verified entry (0: none)
    hash: str = Field(max_length=64)  # its hash (GENESIS for seq 0)
    ok: bool = True
    problem: str | None = Field(default=None, max_length=255)
    bad_seq: int | None = None
    full_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    updated_at: datetime = Field(sa_type=DateTime(timezone=True))
