"""The forwarder's configuration file (JSON, embedded in the measured compose file) and the
launch-bound files it names. Loading fails closed with a message naming the file and field."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, model_validator

from umbra.attest.measurement import ReleaseManifest
from umbra.attest.quote_source import QuoteSourceKind
from umbra.contracts.model import Strict
from umbra.contracts.names import CVM_ID_PATTERN
from umbra.contracts.validation import lines
from umbra.sandbox.models import Endpoint, Host, Port, Tunnel


class ForwarderConfigError(Exception):
    """The forwarder cannot start: the message says which file or field and why."""


class Transparent(Strict):
    """Tools that ignore proxy variables: the forwarder's own :443 (name from the TLS SNI) and :80
    (name from `Host`), handed to the proxy as `CONNECT name:443` / `name:80` (transparent.py)."""

    https_port: Port = 443
    http_port: Port = 80


class Listen(Strict):
    # The forwarder's address on the sandbox network: never 0.0.0.0, or the uplink side could
    # use this CVM's identity.
    host: Host
    proxy_port: Port
    tunnels: list[Tunnel] = Field(default_factory=list)
    transparent: Transparent | None = None
    # The sandbox's resolver (UDP and TCP): every name is this address (dns_responder.py).
    dns_port: Port | None = None

    @model_validator(mode="after")
    def _specific(self) -> Listen:
        address = ipaddress.ip_address(self.host)
        if address.is_unspecified:
            raise ValueError("listen.host must be the sandbox-network address, not a wildcard")
        if self.dns_port is not None and address.version != 4:
            raise ValueError("listen.dns_port needs an IPv4 listen.host (it is the one answer)")
        tcp = [self.proxy_port, *(t.listen_port for t in self.tunnels)]
        if self.transparent is not None:
            tcp += [self.transparent.https_port, self.transparent.http_port]
        if self.dns_port is not None:
            tcp.append(self.dns_port)
        if len(set(tcp)) != len(tcp):
            raise ValueError("listen ports (proxy, tunnels, transparent, dns) must be distinct")
        return self


class Collateral(Strict):
    """Where the Security CVM's collateral comes from: PCCS endpoints, a file, or `relayed`: the
    set the Security CVM's tunnel endpoint sends with its quote (a cloud Dev CVM reaches no
    PCCS). All three are verified alike, every signature up to the pinned root."""

    pccs_urls: list[str] = Field(default_factory=list)
    file: Path | None = None
    relayed: bool = False

    @model_validator(mode="after")
    def _one(self) -> Collateral:
        if [bool(self.pccs_urls), self.file is not None, self.relayed].count(True) != 1:
            raise ValueError("collateral needs exactly one of pccs_urls, file or relayed")
        return self


class Enrollment(Strict):
    """How this Dev CVM gets its tunnel credential (sandbox/forwarder_enroll.py): the one-time
    token from launch data, traded at the Console for the credential after attestation.
    `simulated`: a simulated TD of `simulated_image` signed by `simulated_pki` (embedded mode);
    `configfs`: this TD's quotes, with the launch agent's RTMR3 event log; `emulated`: the same
    from the emulated clouds' TDX module (attest.tdx_port)."""

    console_url: Annotated[str, Field(pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$")]
    token_file: Path
    quote_source: QuoteSourceKind
    event_log: Path | None = None
    simulated_pki: Path | None = None
    simulated_image: str = "umbra-dev-cvm"
    console_ca: Path | None = None
    # A cloud Dev CVM has no DNS: the launch agent writes the Console's address(es) from launch
    # data (`umbra-console-ips`) here, and the forwarder dials the first one, verifying TLS for
    # the URL's host name. Absent: the URL's host is resolved (embedded mode).
    console_ips_file: Path | None = None

    @model_validator(mode="after")
    def _source(self) -> Enrollment:
        if (self.quote_source is QuoteSourceKind.simulated) != (self.simulated_pki is not None):
            raise ValueError("simulated_pki is required with quote_source simulated, and only then")
        return self


class SandboxCa(Strict):
    """Where the forwarder keeps the Security CVM's attested interception CA(s) for its sandbox
    (a volume the sandbox mounts read-only), and how often it asks again (replicas)."""

    file: Path
    refresh: Annotated[float, Field(ge=10, le=86400)] = 300.0


class SandboxEnv(Strict):
    """Where the forwarder keeps the sandbox's `sandbox.env` (a directory the sandbox mounts
    read-only): `base`, this CVM's own values, then the attached profiles' `sandbox_env`, asked
    of the Security CVM every `refresh` seconds (sandbox_env_sync.py)."""

    file: Path
    base: dict[str, str] = Field(default_factory=dict)
    refresh: Annotated[float, Field(ge=1, le=3600)] = 3.0


class ForwarderConfig(Strict):
    apiVersion: Literal["umbra/v1"]
    kind: Literal["ForwarderConfig"]
    listen: Listen
    security_cvm: Endpoint
    security_cvm_release: ReleaseManifest
    collateral: Collateral
    allow_simulated: bool = False
    simulated_root: Path | None = None
    cvm_id_file: Path
    credential_file: Path | None = None
    enrollment: Enrollment | None = None
    sandbox_ca: SandboxCa | None = None
    sandbox_env: SandboxEnv | None = None
    # A cloud Dev CVM has no DNS (its host ruleset drops it, Docker's embedded DNS forwards to
    # nothing): the launch agent writes the Security CVM address(es) of launch data
    # (`umbra-security-cvm-ips`, from which the measured host ruleset is rendered) here, and the
    # forwarder dials the first one instead of resolving `security_cvm.host`. The address is not
    # a trust anchor: whoever answers must pass attestation against the Security release.
    security_cvm_ips_file: Path | None = None
    connect_timeout: Annotated[float, Field(gt=0, le=120)] = 10.0
    handshake_timeout: Annotated[float, Field(gt=0, le=120)] = 30.0
    max_connections: Annotated[int, Field(ge=1, le=65536)] = 256

    @model_validator(mode="after")
    def _simulated(self) -> ForwarderConfig:
        if self.allow_simulated != (self.simulated_root is not None):
            raise ValueError("allow_simulated and simulated_root go together")
        if self.allow_simulated and self.security_cvm_release.tee != "simulated":
            raise ValueError("allow_simulated needs a security_cvm_release with tee: simulated")
        if self.enrollment is not None and self.credential_file is None:
            raise ValueError("enrollment needs credential_file (where the credential is kept)")
        return self


def load_forwarder_config(path: Path) -> ForwarderConfig:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ForwarderConfigError(f"{path}: cannot read forwarder config: {exc}") from None
    try:
        return ForwarderConfig.model_validate(doc)
    except ValidationError as exc:
        msgs = [f"{path}: {line}" for line in lines(exc, "(top level)")]
        raise ForwarderConfigError("\n".join(msgs)) from None


def read_first_ipv4(path: Path, what: str) -> str:
    """The first IPv4 address of a launch-agent file (space/line separated)."""
    try:
        words = path.read_text().split()
    except (OSError, UnicodeDecodeError) as exc:
        raise ForwarderConfigError(f"{path}: cannot read the {what} address: {exc}") from None
    if not words:
        raise ForwarderConfigError(f"{path}: no {what} address")
    try:
        return str(ipaddress.IPv4Address(words[0]))
    except ValueError:
        raise ForwarderConfigError(f"{path}: {words[0][:40]!r} is not an IPv4 address") from None


_CVM_ID = re.compile(CVM_ID_PATTERN)


def read_cvm_id(path: Path) -> str:
    """The CVM id the launch agent wrote (and measured as `umbra.cvm-id`)."""
    try:
        value = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ForwarderConfigError(f"{path}: cannot read the CVM id: {exc}") from None
    if not _CVM_ID.match(value):
        raise ForwarderConfigError(f"{path}: CVM id {value[:40]!r} does not match {CVM_ID_PATTERN}")
    return value


def read_credential(path: Path) -> str:
    try:
        value = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ForwarderConfigError(f"{path}: cannot read the tunnel credential: {exc}") from None
    if not 16 <= len(value) <= 256 or not value.isascii() or not value.isprintable():
        raise ForwarderConfigError(f"{path}: tunnel credential must be 16-256 printable ASCII")
    return value
