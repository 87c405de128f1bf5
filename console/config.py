"""Console settings: one strict model, read from `UMBRA_CONSOLE_*` environment variables or a file.

Everything security-relevant fails closed: no issuer means no user can authenticate, no pinned
bundle keys means no bundle can be uploaded, no key encryption key means no secret can be stored.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit
from uuid import UUID

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from umbra.components.launch_data import measured_document
from umbra.contracts.model import Strict as _Strict
from umbra.contracts.validation import location
from umbra.contracts.web_session_key import decode_web_session_key

ENV_PREFIX = "UMBRA_CONSOLE_"
DEFAULT_DATABASE_URL = "sqlite:///umbra-console.db"
MAX_RETENTION_DAYS = 400  # 400 daily partitions still plan quickly (console/traffic_partitions.py)


class ConfigError(Exception):
    """A configuration that the Console refuses to start with; the message names the setting."""


_STACK = r"^[A-Za-z0-9_.-]{1,100}/[A-Za-z0-9_.-]{1,100}/[A-Za-z0-9_.-]{1,100}$"
_TEAM = r"^[a-z][a-z0-9-]{0,14}[a-z0-9]$"  # what the Pulumi provisioner accepts
TeamStack = Annotated[str, Field(pattern=_STACK, description="org/project/stack of the team stack")]


class GcpTeam(_Strict):
    team_stack: TeamStack
    project: str = Field(pattern=r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
    region: str = Field(pattern=r"^[a-z]+-[a-z]+\d$")
    zone: str = Field(pattern=r"^[a-z]+-[a-z]+\d-[a-z]$")

    @model_validator(mode="after")
    def _zone_in_region(self) -> GcpTeam:
        if not self.zone.startswith(self.region + "-"):
            raise ValueError(f"zone {self.zone!r} is not in region {self.region!r}")
        return self


class AzureTeam(_Strict):
    team_stack: TeamStack
    location: str = Field(pattern=r"^[a-z][a-z0-9]*$")
    zone: Literal["1", "2", "3"] | None = None


class _CloudProvider(_Strict):
    """What every Dev CVM of this cloud boots: the release's image, app-compose and manifest."""

    org: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,100}$")
    image: str = Field(min_length=1, max_length=512)
    app_compose: Path = Field(description="The release's app-compose.json (`umbra image measure`).")
    measurement_manifest: str | None = Field(default=None, max_length=2048)
    default_size: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    disk_gb: int = Field(default=50, ge=10, le=4096)
    # The Dev CVM's data disk when its launch names none (the team's bounds may ask otherwise).
    data_disk_gb: int = Field(default=100, ge=10, le=65536)
    # Where every Dev CVM's Automation API stack keeps its state and what encrypts its secrets:
    # the Console stack's `dev_state_backend_url` and `dev_secrets_provider` outputs (both or
    # neither; the provisioner checks their form). Unset: the pulumi CLI's own login, per replica.
    state_backend_url: str | None = Field(default=None, max_length=512)
    secrets_provider: str | None = Field(default=None, max_length=512)

    @field_validator("app_compose")
    @classmethod
    def _compose_document(cls, value: Path) -> Path:
        try:
            doc = json.loads(value.read_text())
        except OSError as exc:
            raise ValueError(f"cannot read {value} ({exc.strerror})") from None
        except ValueError:
            doc = None
        if measured_document(doc) is None:
            raise ValueError(f"{value} is not an app-compose.json document")
        return value


class GcpProvider(_CloudProvider):
    teams: dict[Annotated[str, Field(pattern=_TEAM)], GcpTeam] = Field(min_length=1)
    default_size: str = Field(default="c3-standard-4", pattern=r"^[a-z0-9][a-z0-9-]{0,63}$")


class AzureProvider(_CloudProvider):
    subscription_id: UUID
    teams: dict[Annotated[str, Field(pattern=_TEAM)], AzureTeam] = Field(min_length=1)
    default_size: str = Field(default="Standard_DC4es_v5", pattern=r"^[A-Za-z0-9_]{1,64}$")


class Settings(_Strict):
    database_url: str = Field(
        default=DEFAULT_DATABASE_URL,
        description="SQLAlchemy URL: sqlite:///PATH (embedded default) or postgresql+psycopg://...",
    )
    auto_migrate: bool = Field(
        default=False,
        description="Run Alembic `upgrade head` before serving (`console serve --migrate`).",
    )
    oidc_issuer: str | None = Field(default=None, description="Issuer URL; `iss` must equal it.")
    oidc_audience: str = Field(default="umbra-console", description="Required `aud` value.")
    oidc_roles_claim: str = Field(
        default="umbra_roles", description="Claim listing 'TEAM:ROLE' entries."
    )
    oidc_algorithms: list[str] = Field(default_factory=lambda: ["RS256", "ES256", "EdDSA"])
    oidc_jwks_ttl_seconds: float = Field(default=300.0, gt=0)
    oidc_jwks_min_refresh_seconds: float = Field(
        default=5.0, ge=0, description="Rate limit on refetching JWKS for an unknown key id."
    )
    oidc_leeway_seconds: int = Field(default=30, ge=0, le=300)
    oidc_allow_insecure_http: bool = Field(
        default=False, description="Allow an http:// issuer; only ever for loopback test issuers."
    )
    bundle_public_keys: list[Path | str] = Field(
        default_factory=list,
        description="Ed25519 keys that may sign policy bundles: each a PEM file path or PEM text.",
    )
    kek: dict[str, str] = Field(
        default_factory=dict, description="Key encryption keys: key id -> base64 of 32 bytes."
    )
    kek_current: str | None = Field(default=None, description="Key id that wraps new data keys.")
    web_session_key: str | None = Field(
        default=None,
        description="Base64 of 32 bytes keying the web view's cookies, the same for every worker "
        "and replica (unset: a random key per process, so only one worker may serve).",
    )
    providers: list[str] = Field(default_factory=lambda: ["local"])
    gcp: GcpProvider | None = Field(
        default=None, description="Settings of the `gcp` provider (JSON in UMBRA_CONSOLE_GCP)."
    )
    azure: AzureProvider | None = Field(
        default=None, description="Settings of the `azure` provider (JSON in UMBRA_CONSOLE_AZURE)."
    )
    reconcile_interval_seconds: float = Field(
        default=10.0,
        ge=0,
        description="PostgreSQL: how often a serving Console takes over provider jobs whose "
        "lease expired (their replica died; 0: only at startup).",
    )
    job_lease_seconds: float = Field(
        default=30.0,
        ge=1,
        le=3600,
        description="PostgreSQL: how long a provider job's lease lasts unless its replica renews "
        "it (every third of this): a killed replica's job is taken over after at most this plus "
        "the reconcile interval.",
    )
    export_otlp_url: str | None = Field(
        default=None,
        description="OTLP/HTTP logs endpoint (`https://host:4318/v1/logs`) traffic and audit are "
        "streamed to (console/export); none: no OTLP export.",
    )
    export_syslog_url: str | None = Field(
        default=None,
        description="RFC 5424 syslog over TLS (RFC 5425 framing) as `tls://host:port`; none: no "
        "syslog export.",
    )
    export_ca_file: Path | None = Field(
        default=None, description="CA bundle the export receivers' certificates chain to."
    )
    export_interval_seconds: float = Field(
        default=2.0, gt=0, le=300, description="How often the exporter looks for new entries."
    )
    export_batch: int = Field(default=500, ge=1, le=10000, description="Entries per sent batch.")
    traffic_retention_days: int | None = Field(
        default=None,
        ge=1,
        le=MAX_RETENTION_DAYS,
        description="Traffic records older than this many whole UTC days are removed (PostgreSQL: "
        "whole day partitions dropped), never before every configured SIEM sink has taken them; "
        "none: kept forever. The audit log is never removed.",
    )
    traffic_maintenance_interval_seconds: float = Field(
        default=3600.0,
        ge=10,
        le=86400,
        description="How often the Console makes traffic partitions ahead (PostgreSQL) and runs "
        "retention.",
    )
    provider_workers: int = Field(
        default=4, ge=1, le=64, description="Concurrent cloud launches/updates/destroys."
    )
    max_request_bytes: int = Field(default=1 << 20, gt=0)
    max_bundle_bytes: int = Field(default=16 << 20, gt=0)
    max_traffic_batch_bytes: int = Field(default=16 << 20, gt=0)
    max_traffic_batch_records: int = Field(default=10_000, gt=0)
    db_statement_timeout_ms: int = Field(
        default=15_000,
        ge=0,
        description="PostgreSQL statement_timeout for the Console's own connections (0: none); "
        "a query over it answers 503 instead of holding a connection.",
    )
    db_unresponsive_seconds: float = Field(
        default=4.0,
        ge=0,
        description="PostgreSQL: a probe unanswered this long marks the database unresponsive "
        "(open connections cut, requests 503 until it answers; 0: no probe).",
    )
    db_probe_interval_seconds: float = Field(default=1.0, gt=0, le=60)
    db_connect_timeout_seconds: int = Field(
        default=3, ge=2, le=60, description="PostgreSQL connect_timeout of new connections."
    )
    release_challenges_per_minute: int = Field(
        default=30, ge=1, description="Per Security CVM: challenge requests beyond this get 429."
    )
    enroll_refusals_per_minute: int = Field(
        default=60,
        ge=1,
        description="Enrollment refusals audited one by one per team (unknown tokens: one key) "
        "per minute and process; the rest become one summary entry a minute.",
    )
    long_poll_max_seconds: int = Field(default=60, ge=1, le=600)
    long_poll_db_interval_seconds: float = Field(
        default=0.5, gt=0, le=1.0, description="How often a long poll rechecks the database."
    )
    release_nonce_ttl_seconds: int = Field(default=120, ge=10, le=3600)
    release_policy: Path | None = Field(
        default=None,
        description="Release manifest (measurement policy) of the Security CVM image; enables "
        "attested secret release.",
    )
    release_binding: Path | None = Field(default=None, description="Optional instance binding.")
    dev_cvm_release_policy: Path | None = Field(
        default=None,
        description="Release manifest of the Dev CVM image: Dev CVMs enroll (get their tunnel "
        "credential) only with a quote of this release. Same collateral and root as release_*.",
    )
    release_collateral: Path | None = Field(default=None, description="Static collateral file.")
    release_pccs: list[str] = Field(default_factory=list, description="PCCS endpoints, in order.")
    release_collateral_cache: Path | None = None
    release_allow_simulated: bool = Field(
        default=False, description="Accept simulated quotes when the policy says tee: simulated."
    )
    release_simulated_root: Path | None = Field(
        default=None, description="The simulated root CA (DER or PEM)."
    )
    embedded_dev: bool = Field(
        default=False,
        description="`umbra up` only: trust the development issuer (console/dev_issuer.py). "
        "Refused unless the database is SQLite and the issuer is on loopback.",
    )
    local_cvm_config: Path | None = Field(
        default=None,
        description="`umbra up` only: the local provider's config (sandbox/local_cvm.py); "
        "without it the local provider records intent only.",
    )
    qemu_cvm_config: Path | None = Field(
        default=None,
        description="The `qemu` provider's config (console/providers_qemu.py): the emulated "
        "cloud's shape, the built OS image's disk, the Dev release's app-compose.json.",
    )

    @field_validator("database_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("sqlite://", "postgresql+psycopg://", "postgresql://")):
            raise ValueError("must be a sqlite:// or postgresql+psycopg:// URL")
        if value.startswith("postgresql://"):
            value = "postgresql+psycopg://" + value.removeprefix("postgresql://")
        return value

    @field_validator("traffic_retention_days", mode="before")
    @classmethod
    def _whole_days(cls, value: object) -> object:
        # "30d", "1.5", "true" or "" are refused, not read as something else
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        if isinstance(value, str) and value.isascii() and value.isdigit():
            return int(value)
        raise ValueError(f"a whole number of days from 1 to {MAX_RETENTION_DAYS}")

    @field_validator("export_otlp_url")
    @classmethod
    def _check_otlp_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("https://", "http://")):
            raise ValueError("must be an http(s):// URL (the OTLP/HTTP logs endpoint)")
        return value

    @field_validator("export_syslog_url")
    @classmethod
    def _check_syslog_url(cls, value: str | None) -> str | None:
        if value is not None:
            host, _, port = value.removeprefix("tls://").rpartition(":")
            if not value.startswith("tls://") or not host or not port.isdigit():
                raise ValueError("must be tls://HOST:PORT (syslog over TLS only)")
        return value

    @field_validator("kek")
    @classmethod
    def _check_kek(cls, value: dict[str, str]) -> dict[str, str]:
        for key_id, encoded in value.items():
            try:
                raw = base64.b64decode(encoded, validate=True)
            except binascii.Error:
                raise ValueError(f"key {key_id!r} is not valid base64") from None
            if len(raw) != 32:
                raise ValueError(f"key {key_id!r} must be 32 bytes (AES-256)")
        return value

    @field_validator("web_session_key")
    @classmethod
    def _check_web_session_key(cls, value: str | None) -> str | None:
        if value is not None:
            decode_web_session_key(value)
        return value

    @model_validator(mode="after")
    def _provider_settings(self) -> Settings:
        for cloud in ("gcp", "azure"):
            configured = getattr(self, cloud) is not None
            if cloud in self.providers and not configured:
                raise ValueError(f"provider {cloud!r} is enabled but {cloud.upper()} is not set")
            if configured and cloud not in self.providers:
                raise ValueError(f"{cloud.upper()} is set but {cloud!r} is not in PROVIDERS")
        return self

    @model_validator(mode="after")
    def _embedded_dev_only_locally(self) -> Settings:
        if self.embedded_dev:
            host = urlsplit(self.oidc_issuer or "").hostname
            if not self.is_sqlite or host not in ("127.0.0.1", "localhost", "::1"):
                raise ValueError(
                    "embedded_dev needs a sqlite:// database and a loopback issuer: it trusts the "
                    "development issuer and is for `umbra up` only"
                )
        return self

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


_LIST_FIELDS = {"oidc_algorithms", "bundle_public_keys", "providers", "release_pccs"}


def settings_from_env(environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
    """Build settings from `UMBRA_CONSOLE_<FIELD>` variables; lists are comma separated, `KEK` is
    `id=base64,id2=base64`, and `KEK_FILE` names a file holding that same text
    (`WEB_SESSION_KEY_FILE` likewise for `WEB_SESSION_KEY`)."""
    env = dict(os.environ if environ is None else environ)
    _refuse_unknown(env)
    data: dict[str, Any] = {}
    for name in Settings.model_fields:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if name in _LIST_FIELDS:
            data[name] = [item.strip() for item in raw.split(",") if item.strip()]
        elif name == "kek":
            data[name] = _parse_keks(raw, ENV_PREFIX + "KEK")
        elif name in ("gcp", "azure"):
            try:
                data[name] = json.loads(raw)
            except ValueError:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()}: not a JSON object") from None
        else:
            data[name] = raw
    kek_file = env.get(ENV_PREFIX + "KEK_FILE")
    if kek_file:
        try:
            text = Path(kek_file).read_text()
        except OSError as exc:
            raise ConfigError(f"{ENV_PREFIX}KEK_FILE: cannot read ({exc.strerror})") from None
        data["kek"] = _parse_keks(text.replace("\n", ","), ENV_PREFIX + "KEK_FILE")
    web_key_file = env.get(ENV_PREFIX + "WEB_SESSION_KEY_FILE")
    if web_key_file:
        # What a Console VM's launch writes (images/console_launch.py, console/web-session-key).
        if "web_session_key" in data:
            raise ConfigError(
                f"{ENV_PREFIX}WEB_SESSION_KEY and {ENV_PREFIX}WEB_SESSION_KEY_FILE: set one"
            )
        try:
            data["web_session_key"] = Path(web_key_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"{ENV_PREFIX}WEB_SESSION_KEY_FILE: cannot read ({exc.strerror})"
            ) from None
    data.update(overrides)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        error = exc.errors(include_input=False)[0]
        where = location(error["loc"], "providers")
        raise ConfigError(f"{ENV_PREFIX}{where.upper()}: {error['msg']}") from None


# Read here but not a field; `UMBRA_CONSOLE__*` (two underscores) is the Console's own hand-off to
# its worker processes (serve.SETTINGS_ENV).
_NOT_FIELDS = frozenset({"KEK_FILE", "WEB_SESSION_KEY_FILE"})


def _refuse_unknown(env: dict[str, str]) -> None:
    """A misspelt `UMBRA_CONSOLE_*` variable would be silently ignored (and its setting left at
    the default): refuse it, naming the closest setting."""
    known = sorted(
        {ENV_PREFIX + name.upper() for name in Settings.model_fields}
        | {ENV_PREFIX + name for name in _NOT_FIELDS}
    )
    for key in sorted(env):
        if not key.startswith(ENV_PREFIX) or key.startswith(ENV_PREFIX + "_") or key in known:
            continue
        names = [name.removeprefix(ENV_PREFIX) for name in known]
        close = difflib.get_close_matches(key.removeprefix(ENV_PREFIX), names, n=1, cutoff=0.75)
        hint = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""
        raise ConfigError(f"{key}: not a Console setting{hint}")


def _parse_keks(text: str, setting: str) -> dict[str, str]:
    keys: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key_id, sep, encoded = item.partition("=")
        if not sep or not key_id:
            raise ConfigError(f"{setting}: entries must be 'KEY_ID=BASE64'")
        keys[key_id.strip()] = encoded.strip()
    return keys


def settings_summary(settings: Settings) -> dict[str, Any]:
    """Settings without key material, for logs."""
    summary: dict[str, Any] = settings.model_dump(mode="json", exclude={"kek", "web_session_key"})
    summary["web_session_key"] = "set" if settings.web_session_key else None
    summary["kek_ids"] = sorted(settings.kek)
    summary["database_url"] = _redact_url(settings.database_url)
    if settings.export_otlp_url:  # credentials in the URL's user part or query stay out of logs
        summary["export_otlp_url"] = _redact_url(settings.export_otlp_url.split("?", 1)[0])
    return summary


def _redact_url(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return scheme + sep + rest
