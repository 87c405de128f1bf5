"""Request and response bodies of the Console API (strict pydantic; unknown fields are errors)."""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from umbra.console.enums import AuditAction, CvmKind, CvmState, Power, Role, Scope, SecretStatus
from umbra.contracts import model as contracts_model
from umbra.contracts.secret_kinds import SecretKind
from umbra.contracts.traffic import Decision, Kind, QuarantineReason
from umbra.policy.normalize import NormalizationError, normalize_host

NAME_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$"
SECRET_NAME_PATTERN = r"^[a-z0-9](?:[a-z0-9._-]{0,126}[a-z0-9])?$"  # noqa: S105 (a pattern)
CVM_ID_PATTERN = r"^cvm_[0-9a-f]{16}$"
MAX_SECRET_BYTES = 64 << 10
MAX_BIGINT = (1 << 63) - 1


def _has_control(value: object) -> bool:
    if isinstance(value, str):
        return any(ord(char) < 0x20 or ord(char) == 0x7F for char in value)
    if isinstance(value, list | tuple):
        return any(_has_control(item) for item in value)
    return False


class Strict(contracts_model.Strict):
    """Unknown fields are errors; no text field may carry control characters (NUL cannot even be
    stored by PostgreSQL), except secret values, which are only ever stored encrypted. (Request and
    response bodies are built field by field, so they stay mutable.)"""

    model_config = ConfigDict(frozen=False)

    @field_validator("*", mode="after")
    @classmethod
    def _no_control_characters(cls, value: object, info: ValidationInfo) -> object:
        if info.field_name != "value" and _has_control(value):
            raise ValueError("must not contain control characters")
        return value


def _host(value: str) -> str:
    try:
        return normalize_host(value)
    except NormalizationError as exc:
        raise ValueError(str(exc)) from None


def to_utc(value: datetime) -> datetime:
    """Normalize to UTC; a time that leaves the representable range is a validation error."""
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:
        raise ValueError("time is out of range once converted to UTC") from None


Host = Annotated[str, Field(min_length=1, max_length=253), AfterValidator(_host)]
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
ProfileName = Annotated[str, Field(pattern=NAME_PATTERN)]
Label = Annotated[str, Field(min_length=1, max_length=255)]


def _ssh_key(value: str) -> str:
    parts = value.split()
    if len(parts) < 2 or not parts[0].startswith(("ssh-", "ecdsa-", "sk-")):
        raise ValueError("not an OpenSSH public key line ('TYPE BASE64 [comment]')")
    return value.strip()


SshKey = Annotated[str, Field(min_length=1, max_length=16384), AfterValidator(_ssh_key)]
MachineSize = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
# A data disk's size in GB (GCP persistent disks and Azure managed disks both stop at 64 TiB).
DiskGb = Annotated[int, Field(ge=1, le=65536)]
ShortToken = Annotated[str, Field(pattern=r"^[A-Za-z0-9._:/-]{1,160}$")]


# -- identity -------------------------------------------------------------------------------
class Me(Strict):
    subject: str
    roles: dict[str, Role]


# -- bundles --------------------------------------------------------------------------------
class BundleInfo(Strict):
    team: str
    serial: int
    hash: str
    keyid: str
    source: str | None
    profiles: list[str]
    uploaded_by: str
    created_at: datetime


# -- CVMs -----------------------------------------------------------------------------------


class CvmCreate(Strict):
    name: Name
    kind: CvmKind = CvmKind.dev
    provider: Name = "local"
    owner: Label | None = Field(default=None, description="Defaults to the caller; admins only.")
    security_cvm_id: Annotated[str, Field(pattern=CVM_ID_PATTERN)] | None = Field(
        default=None, description="Dev CVMs: the Security CVM their egress goes through."
    )
    ssh_keys: list[SshKey] = Field(
        default_factory=list,
        max_length=32,
        description="Owner's SSH public keys (cloud: required).",
    )
    size: MachineSize | None = Field(default=None, description="Machine type; provider default.")
    data_disk_gb: DiskGb | None = Field(
        default=None, description="Data disk (GB) within the team's bounds; provider default."
    )


class CvmUpdate(Strict):
    state: Power | None = None
    security_cvm_id: Annotated[str, Field(pattern=CVM_ID_PATTERN)] | None = None
    ssh_keys: list[SshKey] | None = Field(default=None, min_length=1, max_length=32)
    size: MachineSize | None = None
    data_disk_gb: DiskGb | None = Field(default=None, description="Grow the data disk (GB).")


class CvmEvent(Strict):
    time: datetime
    kind: str
    message: str


class CvmInfo(Strict):
    id: str
    team: str
    name: str
    kind: CvmKind
    owner: str
    provider: str
    provider_ref: str | None
    state: CvmState
    security_cvm_id: str | None
    profiles: list[str]
    replica_of: str | None = Field(
        default=None, description="Security CVM replicas: the pool's first Security CVM."
    )
    replica_index: int | None = Field(
        default=None, description="Security CVMs a team stack runs: the replica number."
    )
    ssh_keys: list[str] = Field(default_factory=list)
    size: str | None = None
    data_disk_gb: int | None = None
    provider_state: dict[str, Any] = Field(
        default_factory=dict, description="Stack, instance id, private IP, digests, events."
    )
    events: list[CvmEvent] = Field(default_factory=list, description="Last provider events.")
    state_reason: str | None = Field(default=None, description="Why the last run failed.")
    created_at: datetime
    updated_at: datetime


class EnrollmentToken(Strict):
    cvm_id: str
    token: str = Field(description="One-time; goes into the CVM's launch data, nothing more.")
    expires_at: datetime


class SecurityReplicaToken(Strict):
    """Replica `replica` of a team's Security CVM pool, registered, and its one-time token."""

    team: str
    replica: int
    cvm_id: str = Field(description="The replica's `umbra.cvm-id` (team stack config).")
    pool_id: str = Field(description="The Security CVM its team's Dev CVMs route to.")
    created: bool = Field(description="Whether this call created the replica's record.")
    token: str = Field(description="One-time; goes into Pulumi secret config, nothing more.")
    expires_at: datetime


class CvmCreated(CvmInfo):
    credential: str | None = Field(
        default=None, description="Security CVMs only: shown once, stored hashed."
    )


class ProfilesUpdate(Strict):
    profiles: list[ProfileName] = Field(max_length=64)


def profiles_etag(profiles: list[str]) -> str:
    """The version of a CVM's attachments a read-modify-write sends back as `If-Match`."""
    import hashlib

    return hashlib.sha256("\n".join(sorted(set(profiles))).encode()).hexdigest()[:32]


class TeamDefaultProfiles(Strict):
    """Profiles the Console attaches to every Dev CVM it launches for the team (any provider)."""

    team: str
    profiles: list[str]
    etag: str = Field(description="Send back as If-Match to change them without a lost update.")
    updated_by: str | None = None
    updated_at: datetime | None = None


class TeamQuotas(Strict):
    """Limits on the team's Dev CVMs (services/team_quotas.py); null / empty: no limit."""

    max_dev_cvms_per_owner: int | None = Field(default=None, ge=0, le=1000)
    machine_types: list[MachineSize] = Field(default_factory=list, max_length=64)
    min_data_disk_gb: DiskGb | None = Field(default=None, description="Each Dev CVM's data disk.")
    max_data_disk_gb: DiskGb | None = Field(default=None, description="Each Dev CVM's data disk.")
    max_data_disk_gb_per_owner: int | None = Field(
        default=None, ge=0, le=10_000_000, description="Sum of one developer's data disks."
    )
    max_data_disk_gb_total: int | None = Field(
        default=None, ge=0, le=100_000_000, description="Sum of the team's data disks."
    )

    @model_validator(mode="after")
    def _bounds(self) -> TeamQuotas:
        low, high = self.min_data_disk_gb, self.max_data_disk_gb
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_data_disk_gb {low} is above max_data_disk_gb {high}")
        return self


class QuotaUsage(Strict):
    """What the quotas count now for one developer (the caller) and their team."""

    owner: str
    dev_cvms: int
    data_disk_gb: int
    team_data_disk_gb: int


class TeamQuotasInfo(TeamQuotas):
    team: str
    updated_by: str | None = None
    updated_at: datetime | None = None
    usage: QuotaUsage | None = Field(default=None, description="The caller's use of the quotas.")


# -- secrets --------------------------------------------------------------------------------
class TeamSecretSet(Strict):
    value: str = Field(min_length=1, max_length=MAX_SECRET_BYTES)
    hosts: list[Host] = Field(default_factory=list, max_length=64)
    kind: SecretKind = Field(
        default=SecretKind.static,
        description="static: `value` is the secret; any other kind: `value` is its JSON document "
        "(contracts/secret_kinds.py).",
    )


class PersonalSecretSet(Strict):
    value: str = Field(min_length=1, max_length=MAX_SECRET_BYTES)
    hosts: list[Host] = Field(min_length=1, max_length=64)
    kind: SecretKind = SecretKind.static


class SecretInfo(Strict):
    """Metadata only: no endpoint ever returns a secret's value."""

    team: str
    scope: Scope
    owner: str | None
    name: str
    ref: str
    hosts: list[str]
    version: int
    kind: SecretKind = SecretKind.static
    status: SecretStatus = SecretStatus.ok
    updated_by: str
    updated_at: datetime


# -- attestation-gated release ---------------------------------------------------------------
class ReleaseChallenge(Strict):
    nonce: str
    expires_at: datetime
    report_data_rule: str


class ReleaseResponse(Strict):
    suite: list[str]
    info: str = Field(description="Base64 HPKE info string.")
    sealed: str = Field(description="Base64 HPKE enc ‖ ciphertext of the release document.")
    count: int


# -- traffic --------------------------------------------------------------------------------
# The record itself is `umbra.contracts.traffic.TrafficRecord` (one schema for proxy and Console).
class IngestResult(Strict):
    received: int
    inserted: int
    duplicates: int
    quarantined: int = Field(default=0, description="Stored aside with a reason; never retried.")


class TrafficRecordOut(Strict):
    id: str
    security_cvm_id: str
    time: datetime
    cvm_id: str | None
    owner: str | None
    team: str
    kind: Kind
    policy_hash: str | None
    method: str | None
    connect_host: str | None
    sni: str | None
    host: str | None
    port: int | None
    pinned_ip: str | None
    path: str | None
    query_keys: list[str]
    decision: Decision
    rule_id: str | None
    reason: str | None
    status: int | None
    bytes_sent: int
    bytes_received: int
    duration_ms: float
    scan_rule_ids: list[str]
    injected_headers: list[str]
    detail: str | None
    llm_model: str | None = None
    llm_input_tokens: int | None = None
    llm_output_tokens: int | None = None
    llm_cache_read_tokens: int | None = None
    llm_cache_write_tokens: int | None = None
    truncated: list[str] = Field(default_factory=list)


class UsageRowOut(Strict):
    day: date
    owner: str | None
    cvm_id: str | None
    model: str
    requests: int
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int


class UsageReportOut(Strict):
    since: datetime
    until: datetime
    rows: list[UsageRowOut]
    totals: dict[str, int]


class TrafficPage(Strict):
    records: list[TrafficRecordOut]
    next_cursor: str | None


class QuarantinedRecord(Strict):
    id: int
    security_cvm_id: str
    record_id: str | None
    reason: QuarantineReason
    detail: str
    excerpt: str
    received_at: datetime


class QuarantinePage(Strict):
    records: list[QuarantinedRecord]
    next_cursor: int | None


# -- audit ----------------------------------------------------------------------------------
class AuditEntryOut(Strict):
    seq: int
    time: datetime
    actor: str
    team: str
    action: AuditAction
    target: str
    details: dict[str, object]
    prev_hash: str
    hash: str


class AuditPage(Strict):
    entries: list[AuditEntryOut]
    next_cursor: int | None


class AttachmentsDoc(Strict):
    cvms: dict[str, dict[str, object]]


class Deactivated(Strict):
    """What `POST /teams/{team}/members/{subject}/deactivate` did (services/people.py)."""

    team: str
    subject: str
    newly: bool = Field(description="False: already deactivated (its CVMs were retried).")
    secrets_erased: int
    cvms_detached: list[str]
    cvms_stopped: list[str]
    cvms_skipped: dict[str, str] = Field(description="CVM id -> why it was left as it is.")


class Reactivated(Strict):
    """What `POST /teams/{team}/members/{subject}/reactivate` did (services/people.py)."""

    team: str
    subject: str
    newly: bool = Field(description="False: they were not deactivated (nothing changed).")
    deactivated_at: datetime | None = Field(description="When the undone deactivation was.")
    deactivated_by: str | None = Field(description="Who deactivated them.")
