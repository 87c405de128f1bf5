"""The CVM launch agent (systemd: umbra-launch-agent.service), run once at boot before anything
else Umbra starts.

1. Read the launch data (`umbra-*` keys, see umbra.components.launch_data) from the cloud's
   metadata service, by address (a team VPC's DNS answers every name with 0.0.0.0): GCP instance
   attributes (`Metadata-Flavor: Google`) or Azure IMDS user data.
2. Validate it strictly: known keys only, canonical app-compose.json whose measured document
   passes its loader (a Dev CVM's host definition, sandbox/dev_definition.py; a Security CVM's
   compose file, the sandbox validator), the copies (compose hash, event list) consistent with what they copy,
   SSH keys exactly when the role is dev-cvm.
3. Extend RTMR3 with the events the verifiers expect, in order (umbra.images.measure's
   release_events + instance_events: one definition of them); on a Dev CVM then this boot's
   events (boot_events): a fresh 16-byte boot id and the SSH host key generated here, inside
   the TD, before anything else runs. Write the event log.
4. Write /run/umbra/launch/; start the Security CVM's compose, or on a Dev CVM the dev host
   (`umbra sandbox host up`: the forwarder and the runc sandbox, sandbox/dev_host.py), then the
   attested SSH ingress on the host (umbra.images.launch_ingress); report ready.
   A Console VM (umbra.images.console_launch): before step 3 its database password and TLS key
   are read by reference with the VM's identity and the key checked against the measured
   certificate; its launch-bound configuration is measured (umbra.console-launch); its files are
   written 0400 for its uid and its compose is started like the Security CVM's.

The host controls the metadata, so nothing is trusted for being there: it is measured before use,
and a verifier refuses a quote whose replayed events differ from the release and the binding.
Bad or missing launch data: extend nothing, start nothing, say why on the serial console.

Why one module: it is the boot sequence above, steps 1 to 4 in order, kept in one file so a
reviewer reads everything a CVM does before it is measured in one place; the metadata sources, RTMR
extenders, starters and reporters are small implementations only `Agent` uses."""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from umbra.attest.errors import QuoteSourceError
from umbra.attest.eventlog import Event, dump_dstack_event_log
from umbra.attest.measurement import canonical_ssh_key
from umbra.attest.tdx_port import QUOTE_SOCKET_NAME, TdxModulePort
from umbra.components.idle_stop import CONFIG_PATH as IDLE_CONFIG_PATH
from umbra.components.idle_stop import TIMER as IDLE_TIMER
from umbra.components.idle_stop import IdleConfig, dev_cvm_config
from umbra.components.launch_data import (
    META_APP_COMPOSE,
    META_COMPOSE_HASH,
    META_CONSOLE_CA,
    META_CONSOLE_IPS,
    META_CONSOLE_TLS_CERT,
    META_CONSOLE_TLS_KEY_REF,
    META_CONSOLE_URL,
    META_CVM_ID,
    META_DATABASE_CA,
    META_DATABASE_PASSWORD_REF,
    META_DATABASE_URL,
    META_DNS_RESOLVERS,
    META_ENROLLMENT_TOKEN,
    META_EVENTS,
    META_HOST_FIREWALL,
    META_INSTANCE_NAME,
    META_KEYS,
    META_LB_IP,
    META_MANIFEST,
    META_ROLE,
    META_SECURITY_CVM_IPS,
    META_SSH_KEYS,
    META_TEAM,
    META_WEB_SESSION_KEY_REF,
    PLACEHOLDER_MARK,
    LaunchData,
)
from umbra.contracts.files import write_atomic
from umbra.contracts.names import CVM_ID_PATTERN
from umbra.images.console_launch import (
    ConsoleLaunchError,
    ConsoleProblem,
    ConsoleSecrets,
    check_console_compose,
    check_console_meta,
    read_console_secrets,
    write_console_files,
)
from umbra.images.launch_ccel import FirmwareLogError
from umbra.images.launch_host import (
    DataDisk,
    Firewall,
    HostSetupError,
    LocalRoutes,
    Nft,
    write_hosts,
    write_resolv_conf,
)
from umbra.images.launch_ingress import AttestedIngress, IngressStartError
from umbra.images.launch_quote_relay import QuoteRelayError
from umbra.images.launch_secrets import SecretReader
from umbra.images.measure import boot_events, release_events
from umbra.images.measure import instance_events as launch_events
from umbra.sandbox.dev_definition import DEFINITION_NAME as DEV_HOST_DEFINITION
from umbra.sandbox.dev_definition import RUNNER as DEV_HOST_RUNNER
from umbra.sandbox.dev_definition import DevCvmHost, DevHostError, load_dev_host
from umbra.sandbox.render import SERVICE_UID, canonical_json
from umbra.sandbox.runtime import RUN_ROOT
from umbra.sandbox.validate import (
    SPOOL_DIR,
    ComposeError,
    load_compose,
    validate_security_compose,
)

# By address, never by name: the team VPC's DNS response policy answers every name (the
# metadata server's `metadata.google.internal` too) with 0.0.0.0 (docs/specs/infra.md, "DNS").
GCP_METADATA = "http://169.254.169.254"
AZURE_IMDS = "http://169.254.169.254"
AZURE_WIRE_SERVER = "http://168.63.129.16"
LAUNCH_DIR = Path("/run/umbra/launch")
# Linux >= 6.16 exposes TDX RTMRs in sysfs; writing a SHA-384 digest extends the register.
RTMR3_SYSFS = Path("/sys/class/misc/tdx_guest/measurements/rtmr3:sha384")
_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_CVM_ID = re.compile(CVM_ID_PATTERN)
_KNOWN = META_KEYS
# Opaque, short-lived, single use (the Console's enrollment endpoint checks it).
_TOKEN = re.compile(r"^[A-Za-z0-9._~+/=-]{16,1024}$")
DATA_MOUNT = Path("/var/lib/umbra/data")
SPOOL = Path(SPOOL_DIR)
_REQUIRED = {META_ROLE, META_TEAM, META_CVM_ID, META_APP_COMPOSE, META_COMPOSE_HASH}
_ROLES = ("dev-cvm", "security-cvm", "console")


class Refusal(StrEnum):
    UNREACHABLE = "metadata_unreachable"
    MISSING = "missing_field"
    UNKNOWN = "unknown_field"
    INVALID = "invalid_field"
    MISMATCH = "copy_mismatch"
    EXTEND_FAILED = "extend_failed"
    HOST_SETUP_FAILED = "host_setup_failed"
    START_FAILED = "start_failed"
    INGRESS_FAILED = "ingress_failed"
    SECRET_UNREADABLE = "secret_unreadable"  # noqa: S105 (a reason)
    # The firmware's event log (a TD's CCEL, the emulated module's) is missing or unusable.
    FIRMWARE_LOG = "firmware_log_unusable"


class LaunchError(Exception):
    def __init__(self, reason: Refusal, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


_CONSOLE_REFUSAL = {
    ConsoleProblem.MISSING: Refusal.MISSING,
    ConsoleProblem.INVALID: Refusal.INVALID,
    ConsoleProblem.MISMATCH: Refusal.MISMATCH,
    ConsoleProblem.SECRET_UNREADABLE: Refusal.SECRET_UNREADABLE,
}


def _console_refusal(exc: ConsoleLaunchError) -> LaunchError:
    return LaunchError(_CONSOLE_REFUSAL[exc.problem], str(exc))


# ---- where launch data comes from ------------------------------------------------------------


class MetadataSource(Protocol):
    def fetch(self) -> dict[str, str]: ...

    def instance_name(self) -> str:
        """The VM's name as the cloud's metadata service gives it."""
        ...


@dataclass(frozen=True)
class GcpMetadata:
    base: str = GCP_METADATA
    timeout: float = 10

    def fetch(self) -> dict[str, str]:
        url = f"{self.base}/computeMetadata/v1/instance/attributes/"
        try:
            r = httpx.get(
                url,
                params={"recursive": "true"},
                headers={"Metadata-Flavor": "Google"},
                timeout=self.timeout,
            )
            r.raise_for_status()
            doc = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise LaunchError(Refusal.UNREACHABLE, f"GCP metadata: {exc}") from None
        if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
            raise LaunchError(Refusal.INVALID, "GCP metadata attributes are not a string map")
        return {k: v for k, v in doc.items() if k.startswith("umbra-")}

    def instance_name(self) -> str:
        try:
            r = httpx.get(
                f"{self.base}/computeMetadata/v1/instance/name",
                headers={"Metadata-Flavor": "Google"},
                timeout=self.timeout,
            )
            r.raise_for_status()
        except httpx.HTTPError as exc:
            raise LaunchError(Refusal.UNREACHABLE, f"GCP instance name: {exc}") from None
        return r.text.strip()


@dataclass(frozen=True)
class AzureUserData:
    """User data is base64 of canonical JSON {"umbra": {...}} (components.launch_data), read from
    IMDS (`compute/userData`). Not custom data: IMDS answers custom data with an empty body, and
    without the VM agent nothing reads the provisioning medium. `file`: a copy (tests)."""

    base: str = AZURE_IMDS
    file: Path | None = None
    timeout: float = 10

    def fetch(self) -> dict[str, str]:
        try:
            if self.file is not None:
                blob = self.file.read_text()
            else:
                r = httpx.get(
                    f"{self.base}/metadata/instance/compute/userData",
                    params={"api-version": "2021-01-01", "format": "text"},
                    headers={"Metadata": "true"},
                    timeout=self.timeout,
                )
                r.raise_for_status()
                blob = r.text
        except (OSError, httpx.HTTPError) as exc:
            raise LaunchError(Refusal.UNREACHABLE, f"Azure user data: {exc}") from None
        try:
            doc = json.loads(base64.b64decode(blob.strip(), validate=True))
            meta = doc["umbra"]
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise LaunchError(Refusal.INVALID, "Azure user data is not base64 {umbra: …}") from None
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise LaunchError(Refusal.INVALID, "Azure user data's umbra map is not strings")
        return meta

    def instance_name(self) -> str:
        try:
            r = httpx.get(
                f"{self.base}/metadata/instance",
                params={"api-version": "2021-02-01"},
                headers={"Metadata": "true"},
                timeout=self.timeout,
            )
            r.raise_for_status()
            name = r.json()["compute"]["name"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise LaunchError(Refusal.UNREACHABLE, f"Azure instance name: {exc}") from None
        if not isinstance(name, str):
            raise LaunchError(Refusal.INVALID, "Azure IMDS compute.name is not a string")
        return name


# ---- validation -------------------------------------------------------------------------------


def _ipv4_list(key: str, value: str) -> tuple[str, ...]:
    ips = tuple(value.split())
    if not ips:
        raise LaunchError(Refusal.INVALID, f"{key}: empty")
    for ip in ips:
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            raise LaunchError(Refusal.INVALID, f"{key}: {ip!r} is not an IPv4 address") from None
    return ips


def enrollment_token(meta: dict[str, str]) -> str | None:
    """The launch data's enrollment token, checked for shape only (never echoed)."""
    token = meta.get(META_ENROLLMENT_TOKEN)
    if token is not None and not _TOKEN.match(token):
        raise LaunchError(Refusal.INVALID, f"{META_ENROLLMENT_TOKEN}: not a token (shape)")
    return token


def parse_launch_data(meta: dict[str, str], cloud: str | None = None) -> LaunchData:
    """`cloud`: where this agent runs (its `--cloud`); the host ruleset launch data carries must
    be the one rendered for it (the ready-report rule names that cloud's endpoint)."""
    unknown = sorted(set(meta) - _KNOWN)
    if unknown:
        raise LaunchError(Refusal.UNKNOWN, f"unknown launch keys {unknown}")
    missing = sorted(_REQUIRED - set(meta))
    if missing:
        raise LaunchError(Refusal.MISSING, f"missing launch keys {missing}")
    role, team, cvm_id = meta[META_ROLE], meta[META_TEAM], meta[META_CVM_ID]
    if role not in _ROLES:
        raise LaunchError(Refusal.INVALID, f"{META_ROLE}: {role!r} is not one of {_ROLES}")
    if not _ID.match(team):
        raise LaunchError(Refusal.INVALID, f"{META_TEAM}: {team!r} is not [a-z0-9-], 1-63 chars")
    # The Console's ids (`cvm_<hex>`): the wire pattern every other end checks them with.
    if not _CVM_ID.match(cvm_id):
        raise LaunchError(Refusal.INVALID, f"{META_CVM_ID}: {cvm_id!r} is not a CVM id")
    app = meta[META_APP_COMPOSE]
    _check_app_compose(app, role)
    keys = [ln for ln in meta.get(META_SSH_KEYS, "").splitlines() if ln.strip()]
    for n, key in enumerate(keys, 1):
        try:
            canonical_ssh_key(key)
        except ValueError as exc:
            raise LaunchError(Refusal.INVALID, f"{META_SSH_KEYS} line {n}: {exc}") from None
    if role == "dev-cvm" and not keys:
        raise LaunchError(Refusal.MISSING, "a Dev CVM needs at least one SSH authorized key")
    if role != "dev-cvm" and keys:
        raise LaunchError(Refusal.INVALID, f"a {role} takes no SSH authorized keys")
    if enrollment_token(meta) is not None and role == "console":
        # The Console is the enrollment authority: it enrolls nowhere.
        raise LaunchError(Refusal.INVALID, f"{META_ENROLLMENT_TOKEN}: a Console takes none")
    try:
        check_console_meta(meta, role, cloud)
    except ConsoleLaunchError as exc:
        raise _console_refusal(exc) from None
    sec_ips = meta.get(META_SECURITY_CVM_IPS)
    if (sec_ips is None) != (META_HOST_FIREWALL not in meta):
        raise LaunchError(
            Refusal.MISSING, f"{META_HOST_FIREWALL} and {META_SECURITY_CVM_IPS} come together"
        )
    if sec_ips is not None and role != "dev-cvm":
        raise LaunchError(Refusal.INVALID, f"{META_HOST_FIREWALL}: only a Dev CVM takes one")
    resolvers = meta.get(META_DNS_RESOLVERS)
    if resolvers is not None and role != "security-cvm":
        raise LaunchError(Refusal.INVALID, f"{META_DNS_RESOLVERS}: only a Security CVM takes them")
    if resolvers is not None and any(
        ipaddress.IPv4Address(ip).is_loopback for ip in _ipv4_list(META_DNS_RESOLVERS, resolvers)
    ):
        # A loopback upstream is what makes Docker < 26 forward internal networks' DNS from the
        # host's namespace (CVE-2024-29018): never configure one.
        raise LaunchError(Refusal.INVALID, f"{META_DNS_RESOLVERS}: loopback resolvers refused")
    lb_ip = meta.get(META_LB_IP)
    if lb_ip is not None and role not in ("security-cvm", "console"):
        # Only replicas sit behind a load balancer; on a Dev CVM it would be one more local
        # address outside the measured host ruleset's view.
        raise LaunchError(Refusal.INVALID, f"{META_LB_IP}: only a Security CVM or Console replica")
    console_ips = meta.get(META_CONSOLE_IPS)
    if console_ips is not None and sec_ips is None:
        # The Console path is a rule of the measured host ruleset: no ruleset, no path.
        raise LaunchError(Refusal.MISSING, f"{META_CONSOLE_IPS} needs {META_HOST_FIREWALL}")
    data = LaunchData(
        role=role,
        team=team,
        cvm_id=cvm_id,
        app_compose=app,
        measurement_manifest=meta.get(META_MANIFEST),
        ssh_authorized_keys=tuple(keys),
        security_cvm_ips=_ipv4_list(META_SECURITY_CVM_IPS, sec_ips) if sec_ips else (),
        dns_resolvers=_ipv4_list(META_DNS_RESOLVERS, resolvers) if resolvers else (),
        lb_ip=_ipv4_list(META_LB_IP, lb_ip)[0] if lb_ip else None,
        console_ips=_ipv4_list(META_CONSOLE_IPS, console_ips) if console_ips else (),
        console_url=meta.get(META_CONSOLE_URL),
        console_ca=meta.get(META_CONSOLE_CA),
        database_ca=meta.get(META_DATABASE_CA),
        database_url=meta.get(META_DATABASE_URL),
        database_password_ref=meta.get(META_DATABASE_PASSWORD_REF),
        console_tls_cert=meta.get(META_CONSOLE_TLS_CERT),
        console_tls_key_ref=meta.get(META_CONSOLE_TLS_KEY_REF),
        web_session_key_ref=meta.get(META_WEB_SESSION_KEY_REF),
        cloud=cloud,
        instance_name=meta.get(META_INSTANCE_NAME),
    )
    # The ruleset is a copy of what the addresses render to (components.host_firewall): the host
    # cannot slip other rules in, and what is loaded is measured (umbra.host-firewall).
    if sec_ips is not None and meta[META_HOST_FIREWALL] != data.host_firewall:
        raise LaunchError(
            Refusal.MISMATCH, f"{META_HOST_FIREWALL} is not the ruleset for {META_SECURITY_CVM_IPS}"
        )
    if meta[META_COMPOSE_HASH] != data.compose_sha256:
        raise LaunchError(Refusal.MISMATCH, f"{META_COMPOSE_HASH} is not the app-compose's SHA-256")
    if META_EVENTS in meta:
        try:
            copy = json.loads(meta[META_EVENTS])
        except ValueError:
            copy = None
        if copy != data.expected_events():
            raise LaunchError(Refusal.MISMATCH, f"{META_EVENTS} differs from the launch data")
    return data


_COMPOSE_FIELDS = {"docker_compose_file", "manifest_version", "name", "runner"}
_DEV_HOST_FIELDS = {"dev_cvm_host", "manifest_version", "name", "runner"}


def _check_app_compose(text: str, role: str) -> None:
    try:
        doc = json.loads(text)
    except ValueError:
        raise LaunchError(Refusal.INVALID, f"{META_APP_COMPOSE} is not JSON") from None
    if not isinstance(doc, dict) or set(doc) not in (_COMPOSE_FIELDS, _DEV_HOST_FIELDS):
        raise LaunchError(Refusal.INVALID, f"{META_APP_COMPOSE} has the wrong fields")
    runner = "docker-compose" if "docker_compose_file" in doc else DEV_HOST_RUNNER
    if doc["manifest_version"] != 2 or doc["runner"] != runner:
        raise LaunchError(Refusal.INVALID, f"{META_APP_COMPOSE}: want manifest 2, {runner}")
    if canonical_json(doc) != text:
        # The measured bytes must be the canonical form, or two texts could mean one release.
        raise LaunchError(Refusal.INVALID, f"{META_APP_COMPOSE} is not canonical JSON")
    if "dev_cvm_host" in doc:
        if role != "dev-cvm":
            raise LaunchError(
                Refusal.INVALID, "dev_cvm_host: only a Dev CVM runs a host definition"
            )
        if not isinstance(doc["dev_cvm_host"], str):
            raise LaunchError(Refusal.INVALID, "dev_cvm_host is not a string")
        try:
            load_dev_host(doc["dev_cvm_host"], "dev_cvm_host")
        except DevHostError as exc:
            raise LaunchError(Refusal.INVALID, str(exc)) from None
        return
    if not isinstance(doc["docker_compose_file"], str):
        raise LaunchError(Refusal.INVALID, "docker_compose_file is not a string")
    compose: str = doc["docker_compose_file"]
    try:
        if compose.startswith(PLACEHOLDER_MARK):
            load_compose(compose)  # starts nothing useful; no verifier accepts its hash
        elif role == "console":
            check_console_compose(compose)
        elif role == "dev-cvm":
            raise LaunchError(
                Refusal.INVALID,
                f"{META_APP_COMPOSE}: a Dev CVM release is a host definition (dev_cvm_host, "
                f"runner {DEV_HOST_RUNNER}), not a compose file",
            )
        else:
            validate_security_compose(compose)
    except ComposeError as exc:
        raise LaunchError(Refusal.INVALID, f"docker_compose_file: {exc}") from None


def dev_host_definition(data: LaunchData) -> DevCvmHost:
    """A Dev CVM's measured host definition (already checked by parse_launch_data)."""
    try:
        return load_dev_host(json.loads(data.app_compose)["dev_cvm_host"])
    except (KeyError, DevHostError) as exc:
        raise LaunchError(Refusal.INVALID, f"dev_cvm_host: {exc}") from None


def sandbox_user(data: LaunchData) -> str:
    """The sandbox's login user, as the (validated, measured) host definition names it."""
    return dev_host_definition(data).ssh_ingress.user


def launch_event_list(data: LaunchData) -> list[Event]:
    """The RTMR3 events, in extend order, from the one definition verifiers replay."""
    compose_hash = hashlib.sha256(data.app_compose.encode()).digest()
    console = data.console_launch_sha256
    return release_events(compose_hash) + launch_events(
        data.role,
        data.cvm_id,
        list(data.ssh_authorized_keys),
        data.host_firewall,
        bytes.fromhex(console) if console is not None else None,
    )


@dataclass(frozen=True)
class BootIdentity:
    """What a Dev CVM measures per boot: a random boot id and the SSH host key born in the TD.
    The private key exists only in memory and in the root-only file sshd reads: never in launch
    data, the event log, a log line or anything the Console sees."""

    boot_id: str
    public_line: str  # canonical `ssh-ed25519 base64`: the umbra.ssh-host-key payload
    private_pem: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> BootIdentity:
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
        pub = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        return cls(os.urandom(16).hex(), canonical_ssh_key(pub.decode()), pem)

    def events(self, role: str) -> list[Event]:
        return boot_events(role, self.boot_id, self.public_line)


# ---- measuring --------------------------------------------------------------------------------


class Extender(Protocol):
    def extend(self, event: Event) -> None: ...


@dataclass(frozen=True)
class SysfsRtmr:
    """TDX guest: write the event's SHA-384 digest to the RTMR3 measurement file."""

    path: Path = RTMR3_SYSFS

    def extend(self, event: Event) -> None:
        try:
            with self.path.open("wb", buffering=0) as f:
                f.write(event.digest)
        except OSError as exc:
            raise LaunchError(Refusal.EXTEND_FAILED, f"{self.path}: {exc.strerror}") from None


@dataclass(frozen=True)
class TdxModuleRtmr:
    """Emulated clouds (QEMU/TCG, no TDX): the host's simulated TDX module keeps RTMR3; the digest
    goes over its virtio-serial port (attest.tdx_port), as SysfsRtmr's goes to the kernel."""

    port: TdxModulePort = field(default_factory=lambda: TdxModulePort(wait=60.0))

    def firmware_events(self) -> list[Event]:
        return self.port.firmware_events()

    def extend(self, event: Event) -> None:
        try:
            self.port.extend(3, event.digest)
        except QuoteSourceError as exc:
            raise LaunchError(Refusal.EXTEND_FAILED, str(exc)) from None


@dataclass(frozen=True)
class LogOnly:
    """Simulated TEE in a separate process: the written event log *is* the simulator's input
    (`umbra proxy serve --quote-source simulated --event-log …`)."""

    def extend(self, event: Event) -> None:
        return None


# ---- writing, starting, reporting -------------------------------------------------------------


def _write(path: Path, data: str | bytes, mode: int = 0o644, owner: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    write_atomic(path, data, mode, owner=None if owner is None else (owner, owner))


def write_launch_dir(
    root: Path,
    data: LaunchData,
    events: Sequence[Event],
    token: str | None = None,
    boot: BootIdentity | None = None,
) -> Path:
    """Everything the CVM's services read from /run/umbra/launch; returns the measured document's
    path (the Dev CVM's dev-cvm.json, else the compose file)."""
    doc = json.loads(data.app_compose)
    # The enrolling service's launch directory: the forwarder's on a Dev CVM, the proxy's on a
    # Security CVM (its compose mounts only its own).
    dev = data.role == "dev-cvm"
    service = root / ("forwarder" if dev else "security")
    if token is not None:
        # Short-lived, exchanged once at the Console by the enrolling service (its uid only: the
        # proxy container's, or root's for the Dev CVM's host forwarder); never measured or
        # logged.
        _write(
            service / "enrollment-token", token + "\n", 0o400, owner=None if dev else SERVICE_UID
        )
    _write(root / "app-compose.json", data.app_compose)
    if "dev_cvm_host" in doc:
        compose = root / DEV_HOST_DEFINITION
        _write(compose, doc["dev_cvm_host"])
    else:
        compose = root / "docker-compose.yaml"
        _write(compose, doc["docker_compose_file"])
    _write(root / "role", data.role + "\n")
    _write(root / "team", data.team + "\n")
    log = dump_dstack_event_log(events)
    _write(root / "event-log.json", log)
    if data.role == "dev-cvm":
        _write(service / "cvm-id", data.cvm_id + "\n")
        # What the forwarder's enrollment reads (sandbox/render.py): the TD's event log for its
        # quote, and where the Console is (by address: the Dev CVM has no DNS).
        _write(service / "event-log.json", log)
        if data.console_ips:
            _write(service / "console-ips", "\n".join(data.console_ips) + "\n")
        if data.security_cvm_ips:
            # The forwarder dials this (no DNS); the measured host ruleset admits exactly it.
            _write(service / "security-cvm-ips", "\n".join(data.security_cvm_ips) + "\n")
        if data.console_ca:
            _write(service / "console-ca.pem", data.console_ca)
        _write(root / "ssh/authorized_keys", "\n".join(data.ssh_authorized_keys) + "\n")
        if boot is None:
            raise LaunchError(Refusal.HOST_SETUP_FAILED, "a Dev CVM boots with a host key")
        # Born in this TD at this boot (measured: umbra.ssh-host-key); root-only, never leaves.
        # The directory stays 0755: sshd reads authorized_keys as the login user.
        ssh = root / "ssh"
        _write(ssh / "ssh_host_ed25519_key", boot.private_pem, 0o600)
        _write(ssh / "ssh_host_ed25519_key.pub", boot.public_line + "\n")
        _write(ssh / "cvm-id", data.cvm_id + "\n")  # the attested ingress's launch_dir
        _write(ssh / "boot-id", boot.boot_id + "\n")
    elif data.role == "security-cvm":
        _write(service / "security-cvm-id", data.cvm_id + "\n")
        _write(service / "event-log.json", log)
        # Dev CVMs are known from the Console's attachments (each enrolled Dev CVM's credential
        # hash): the proxy's local identities file is empty, and nothing in launch data adds one.
        _write(service / "identities.yaml", "cvms: []\n")
        if data.console_ca:
            _write(service / "console-ca.pem", data.console_ca)
    if data.measurement_manifest:
        _write(root / "measurement-manifest.json", data.measurement_manifest)
    return compose


class Starter(Protocol):
    def start(self, compose: Path) -> None: ...


@dataclass(frozen=True)
class DockerCompose:
    argv: tuple[str, ...] = ("docker", "compose")

    def start(self, compose: Path) -> None:
        cmd = [*self.argv, "-f", str(compose), "up", "--detach", "--no-build", "--pull", "never"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise LaunchError(Refusal.START_FAILED, " / ".join(tail) or "compose up failed")


@dataclass(frozen=True)
class ComposeRunnerStart:
    """The CVM's own path: load the image archives shipped in the OS image (checked against the
    compose's digest pins), then run the measured compose with Debian's docker-compose
    (umbra.images.compose_runner)."""

    images_dir: Path
    state_dir: Path
    # Development and CI only: a machine without configfs-tsm drops the quote interface's
    # mount (the service cannot quote; said in the output) instead of refusing to start.
    allow_missing_tsm: bool = False
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)

    def start(self, compose: Path) -> None:
        from umbra.images import image_store
        from umbra.images.compose_runner import ComposeRunError, ComposeRunner

        start_docker_engine()
        try:
            images = image_store.load(
                sorted(self.images_dir.glob(f"*{image_store.ARCHIVE_SUFFIX}"))
            )
            runner = ComposeRunner(self.state_dir, images, self.allow_missing_tsm, say=self.say)
            runner.up(compose.read_text())
        except (image_store.ImageStoreError, ComposeRunError, OSError) as exc:
            raise LaunchError(Refusal.START_FAILED, str(exc)) from None


def start_docker_engine(
    systemd: Path = Path("/run/systemd/system"), engine: Path = Path("/run/docker.sock")
) -> None:
    """Docker is not enabled at boot (images.os_image.DISABLED_UNITS): a Dev CVM runs no host
    dockerd, whose FORWARD-drop ruleset would cut the forwarder's egress. A compose role starts
    it here, before the first `docker load`. Without systemd as init (a development host, CI),
    or with an engine already listening, the engine is the caller's."""
    if not systemd.is_dir() or engine.is_socket():
        return
    try:
        done = subprocess.run(["systemctl", "start", "docker.service"], capture_output=True,
                              text=True, check=False, timeout=300)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(Refusal.START_FAILED, f"systemctl start docker.service: {exc}") from None
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip()[-300:]
        raise LaunchError(Refusal.START_FAILED, f"systemctl start docker.service: {why}")


@dataclass(frozen=True)
class DevHostStart:
    """A Dev CVM's start: `umbra sandbox host up` on the measured dev-cvm.json (sandbox/dev_host.py:
    the forwarder, the runc sandbox and their supervisor). A refusal or failure there is this
    launch's START_FAILED, with its reason. `timeout` outlasts `up`'s own wait for the forwarder
    (dev_host.FORWARDER_START_TIMEOUT), so `up` says why first; the unit's TimeoutStartSec
    outlasts this and the ingress's start (tests/images/test_dev_host.py holds the chain)."""

    root: Path
    image_dir: Path
    argv: tuple[str, ...] = (str(Path(sys.executable).parent / "umbra"), "sandbox", "host", "up")
    timeout: float = 720

    def start(self, compose: Path) -> None:
        cmd = [*self.argv, "--definition", str(compose), "--root", str(self.root),
               "--image-dir", str(self.image_dir)]  # fmt: skip
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, check=False, timeout=self.timeout
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise LaunchError(Refusal.START_FAILED, f"umbra sandbox host up: {exc}") from None
        if done.returncode != 0:
            tail = " / ".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise LaunchError(Refusal.START_FAILED, tail or "umbra sandbox host up failed")

    def sandbox_pid_file(self) -> Path:
        """runc's pid file of the sandbox's init (sandbox/dev_host.py): the ingress enters it."""
        return self.root / "sandbox.pid"


class QuoteRelay(Protocol):
    def start(self, socket: Path) -> None: ...


class IdleStop(Protocol):
    def start(self, config: IdleConfig) -> None: ...


@dataclass(frozen=True)
class SystemdIdleStop:
    """Arms the image's idle auto-stop on a Dev CVM: the config for this boot (tmpfs), then the
    timer, which the image installs but does not enable (a Security CVM must never stop)."""

    config_path: Path = Path(IDLE_CONFIG_PATH)
    argv: tuple[str, ...] = ("systemctl", "start", "--no-block", IDLE_TIMER)

    def start(self, config: IdleConfig) -> None:
        _write(self.config_path, json.dumps(asdict(config), sort_keys=True) + "\n")
        try:
            done = subprocess.run(
                list(self.argv), capture_output=True, text=True, check=False, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise OSError(f"{self.argv[0]}: {exc}") from None
        if done.returncode != 0:
            tail = " / ".join((done.stderr or done.stdout).strip().splitlines()[-2:])
            raise OSError(f"{' '.join(self.argv)} failed (exit {done.returncode}): {tail}")


class Reporter(Protocol):
    def ready(self, data: LaunchData) -> None: ...


@dataclass(frozen=True)
class GcpGuestAttribute:
    base: str = GCP_METADATA

    def ready(self, data: LaunchData) -> None:
        httpx.put(
            f"{self.base}/computeMetadata/v1/instance/guest-attributes/umbra/ready",
            content=data.compose_sha256,
            headers={"Metadata-Flavor": "Google"},
            timeout=10,
        ).raise_for_status()


_AZURE_READY = (
    '<?xml version="1.0" encoding="utf-8"?><Health><GoalStateIncarnation>{inc}'
    "</GoalStateIncarnation><Container><ContainerId>{cid}</ContainerId><RoleInstanceList>"
    "<Role><InstanceId>{iid}</InstanceId><Health><State>Ready</State></Health></Role>"
    "</RoleInstanceList></Container></Health>"
)


@dataclass(frozen=True)
class AzureWireServer:
    """With the VM agent off, the guest itself reports Ready to the wire server's goal state."""

    base: str = AZURE_WIRE_SERVER

    def ready(self, data: LaunchData) -> None:
        headers = {"x-ms-version": "2012-11-30"}
        goal = httpx.get(f"{self.base}/machine/?comp=goalstate", headers=headers, timeout=10)
        goal.raise_for_status()

        def tag(name: str) -> str:
            m = re.search(f"<{name}>([^<]*)</{name}>", goal.text)
            if m is None:
                raise LaunchError(Refusal.START_FAILED, f"goal state has no {name}")
            return m.group(1)

        body = _AZURE_READY.format(
            inc=tag("Incarnation"), cid=tag("ContainerId"), iid=tag("InstanceId")
        )
        httpx.post(
            f"{self.base}/machine/?comp=health",
            content=body,
            headers=headers | {"Content-Type": "text/xml;charset=utf-8"},
            timeout=10,
        ).raise_for_status()


# ---- the run ----------------------------------------------------------------------------------


@dataclass
class Agent:
    source: MetadataSource
    extender: Extender
    starter: Starter
    reporter: Reporter | None
    launch_dir: Path = LAUNCH_DIR
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)
    firewall: Firewall = field(default_factory=Nft)
    etc_dir: Path = Path("/etc")
    # Dev CVMs: the persistent disk the sandbox's directory lives on (sandbox/dev_host.py).
    data_disk: DataDisk | None = None
    # Dev CVMs: what starts the measured host definition (DevHostStart). None: the compose
    # `starter` runs whatever the launch data carries (a placeholder, tests with a stub).
    dev_host: Starter | None = None
    # Security CVMs: the spool directory the compose's `spool` volume binds (SPOOL_DIR, on the
    # data disk), created for the proxy's uid. None: not created (tests without the compose).
    spool_dir: Path | None = None
    # Dev CVMs: the attested SSH ingress, started after the compose. None: no SSH at all.
    ingress: AttestedIngress | None = None
    # Dev CVMs: arms the idle auto-stop timer after the compose and the ingress. None: off.
    idle_stop: IdleStop | None = None
    # The cloud this runs on: the host ruleset must admit exactly its ready report.
    cloud: str | None = None
    # The firmware's events of RTMR0-2, written ahead of RTMR3's into the event log the
    # services serve, so that a verifier can replay every RTMR: a TD's CCEL (`CcelReader`), the
    # emulated clouds' TDX module's. Read before anything is measured; a failure refuses.
    # None: RTMR3's events only (`--tee simulated`, whose quote source replays that log).
    firmware_log: Callable[[], Sequence[Event]] | None = None
    # Consoles: reads its database password and TLS key by reference with the VM's identity
    # (launch_secrets). None: a Console launch is refused (nothing to read its secrets with).
    secrets: SecretReader | None = None
    # Consoles: the uid its secret files belong to (None: the agent's own; tests).
    console_uid: int | None = SERVICE_UID
    # Security CVMs on the emulated clouds (`--tee emulated`): the quotes-only relay to the
    # host's TDX module the proxy asks (launch_quote_relay), started before the compose.
    quote_relay: QuoteRelay | None = None
    # Replicas behind a GCP passthrough load balancer (`umbra-lb-ip`): adds the
    # balancer's address as a local route. None: not added, said on the serial console.
    local_routes: LocalRoutes | None = None

    def run(self) -> LaunchData:
        """Raises LaunchError (after saying why) when it refuses; starts nothing then."""
        try:
            meta = self.source.fetch()
            data = parse_launch_data(meta, self.cloud)
            if data.instance_name is not None:
                # Launch data copied to another VM: refused before anything is measured.
                actual = self.source.instance_name()
                if actual != data.instance_name:
                    raise LaunchError(
                        Refusal.MISMATCH,
                        f"{META_INSTANCE_NAME}: the launch data is for VM {data.instance_name!r}, "
                        f"this VM is {actual!r}",
                    )
            token = enrollment_token(meta)
            # Read and checked before anything is measured: a key that is not the measured
            # certificate's, or a secret that cannot be read, starts nothing.
            console = self._console_secrets(data) if data.role == "console" else None
            # Read before anything is measured: without it no verifier accepts this CVM.
            firmware = self._firmware_events()
            events = launch_event_list(data)
            boot = BootIdentity.generate() if data.role == "dev-cvm" else None
            if boot is not None:
                events += boot.events(data.role)
            if data.is_placeholder:
                self.say("umbra-launch: PLACEHOLDER compose: no verifier will accept this CVM")
            # Measure first: whatever runs afterwards is already bound into RTMR3.
            for event in events:
                self.extender.extend(event)
            logged = [*firmware, *events]
            compose = write_launch_dir(self.launch_dir, data, logged, token, boot)
            if console is not None:
                try:
                    write_console_files(self.launch_dir, data, console, self.console_uid)
                except OSError as exc:
                    raise LaunchError(Refusal.HOST_SETUP_FAILED, f"console files: {exc}") from None
            self._host(data)
            if data.role == "security-cvm" and self.quote_relay is not None:
                try:
                    self.quote_relay.start(self.launch_dir / "security" / QUOTE_SOCKET_NAME)
                except QuoteRelayError as exc:
                    raise LaunchError(Refusal.START_FAILED, str(exc)) from None
                self.say("umbra-launch: TDX quote relay started for the proxy")
            if self.dev_host is not None and compose.name == DEV_HOST_DEFINITION:
                self.dev_host.start(compose)
            else:
                self.starter.start(compose)
        except LaunchError as exc:
            self.say(f"umbra-launch: REFUSED, nothing started: {exc}")
            raise
        # A placeholder compose is no release: nothing to log into.
        if self.ingress is not None and data.role == "dev-cvm" and not data.is_placeholder:
            try:
                config = self.ingress.start(self.launch_dir, sandbox_user(data))
            except IngressStartError as exc:
                # The compose runs; with no ingress nobody can log in (closed, not open).
                self.say(f"umbra-launch: attested SSH ingress NOT started: {exc}")
                raise LaunchError(Refusal.INGRESS_FAILED, str(exc)) from None
            self.say(
                f"umbra-launch: attested SSH ingress started on port {config.listen.port} "
                f"(sandbox pid file {config.sandbox.pid_file})"
            )
        if self.idle_stop is not None and data.role == "dev-cvm" and not data.is_placeholder:
            self._arm_idle_stop(data)
        self.say(
            f"umbra-launch: {data.role} {data.cvm_id} started, compose-hash {data.compose_sha256}"
        )
        if self.reporter is not None:
            try:
                self.reporter.ready(data)
            except (httpx.HTTPError, LaunchError) as exc:
                self.say(f"umbra-launch: could not report ready: {exc}")
        return data

    def _firmware_events(self) -> list[Event]:
        if self.firmware_log is None:
            return []
        try:
            return list(self.firmware_log())
        except (QuoteSourceError, FirmwareLogError) as exc:
            raise LaunchError(Refusal.FIRMWARE_LOG, f"the firmware's event log: {exc}") from None

    def _console_secrets(self, data: LaunchData) -> ConsoleSecrets:
        if self.secrets is None:
            raise LaunchError(Refusal.SECRET_UNREADABLE, "no secret reader for this cloud")
        try:
            return read_console_secrets(data, self.secrets)
        except ConsoleLaunchError as exc:
            raise _console_refusal(exc) from None

    def _arm_idle_stop(self, data: LaunchData) -> None:
        """Not fatal: idle auto-stop saves cost, it guards nothing. Said loudly when it fails."""
        assert self.idle_stop is not None
        definition = dev_host_definition(data)
        # The sandbox's dtach sockets as the host sees them: inside its mounted tree.
        sessions = RUN_ROOT / data.cvm_id / "rootfs" / definition.ssh_ingress.sessions_dir[1:]
        config = replace(
            dev_cvm_config("", definition.ssh_ingress.port), sessions_dir=str(sessions)
        )
        try:
            self.idle_stop.start(config)
        except OSError as exc:
            self.say(f"umbra-launch: WARNING idle auto-stop NOT armed: {exc}")
            return
        self.say(f"umbra-launch: idle auto-stop armed ({config.idle_minutes} min)")

    def _host(self, data: LaunchData) -> None:
        """Host configuration, before any container: firewall, names, the data disk."""
        try:
            ruleset = data.host_firewall
            if ruleset is not None:
                self.firewall.load(ruleset)
                self.say("umbra-launch: host firewall loaded (measured: umbra.host-firewall)")
            elif data.role == "dev-cvm":
                self.say("umbra-launch: WARNING no umbra-host-firewall in the launch data")
            if data.lb_ip is not None:
                if self.local_routes is None:
                    self.say(f"umbra-launch: WARNING no local route for {data.lb_ip}: the load "
                             "balancer's packets will be dropped")  # fmt: skip
                else:
                    self.local_routes.add(data.lb_ip)
                    self.say(f"umbra-launch: load balancer address {data.lb_ip} is local")
            if data.security_cvm_ips:
                write_hosts(self.etc_dir, data.security_cvm_ips)
            if data.dns_resolvers:
                write_resolv_conf(self.etc_dir, data.dns_resolvers)
            if self.data_disk is not None and data.role != "console":
                # Dev: the workspace. Security: the proxy's spool (unshipped traffic records).
                # The Console has none: its state is the managed database.
                self.say(f"umbra-launch: {self.data_disk.mount()}")
            if data.role == "security-cvm" and self.spool_dir is not None:
                # The compose's `spool` volume binds it; the proxy (SERVICE_UID) owns it alone.
                self.spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                os.chown(self.spool_dir, SERVICE_UID, SERVICE_UID)
                self.spool_dir.chmod(0o700)
        except (HostSetupError, OSError) as exc:
            raise LaunchError(Refusal.HOST_SETUP_FAILED, str(exc)) from None


def serial_console(path: Path) -> Callable[[str], None]:
    """Lines go to the serial console (what the cloud's serial log shows) and to stderr."""

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        try:
            with path.open("a") as f:
                f.write(line + "\n")
        except OSError:
            pass

    return say
