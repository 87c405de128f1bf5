"""Typed, strict inputs for the measured release documents and the forwarder (pydantic v2,
extra="forbid").

Release-level inputs (images, ports, the Security CVM's golden values) go into the measured
document (the Security CVM's compose file, the Dev CVM's host definition `dev-cvm.json`) and so
into the compose hash. Instance-level inputs (the CVM id, the developer's SSH keys, the tunnel
credential) are launch-bound: written to /run/umbra/launch by the launch agent, which extends
the measured ones into RTMR3 (see umbra.images.measure).
"""

from __future__ import annotations

import ipaddress
import re
from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import AfterValidator, Field, model_validator

from umbra.attest.measurement import ReleaseManifest
from umbra.attest.quote_source import QuoteSourceKind
from umbra.contracts.model import Strict
from umbra.contracts.names import check_host

# name[:tag]@sha256:<64 hex>. A tag is informative only: the digest is what gets pulled.
_IMAGE_RE = re.compile(
    r"^(?:[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?(?::[0-9]{1,5})?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?@sha256:[0-9a-f]{64}$"
)
NAME_PATTERN = r"^[a-z][a-z0-9-]{0,30}$"


def check_image_ref(ref: str) -> str:
    if not _IMAGE_RE.match(ref):
        raise ValueError(
            f"image {ref!r} is not pinned by digest: want name[:tag]@sha256:<64 lowercase hex>"
        )
    return ref


ImageRef = Annotated[str, AfterValidator(check_image_ref)]
Host = Annotated[str, AfterValidator(check_host)]
Port = Annotated[int, Field(ge=1, le=65535)]


class Endpoint(Strict):
    host: Host
    port: Port


class Tunnel(Strict):
    """A raw-TCP destination the sandbox may reach at forwarder:listen_port (e.g. git over SSH).

    The destination is fixed here, never chosen by the sandbox; the proxy still decides by policy.
    """

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    listen_port: Port
    host: Host
    port: Port


class SandboxImageKeys(Strict):
    """The sandbox image a Dev CVM release runs, by the two keys of sandbox/image.py: the base
    tree's (`recipe_key`: SHA-256 of suite, mirrors, packages, npm pins, user) and Umbra's files
    layer's (`files_key`: SHA-256 of every file the build writes over it), 16 hex digits each.
    The OS image ships the tree built from exactly these keys (`/usr/lib/umbra/sandbox-image`)."""

    recipe_key: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    files_key: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]


class SecurityImages(Strict):
    proxy: ImageRef  # one process: proxy, tunnel endpoint and policy puller


# The Dev CVM's published SSH ingress. Port 22 is never opened on a Dev CVM's network.
ATTESTED_SSH_PORT: Final = 8022


PccsUrl = Annotated[str, Field(pattern=r"^https?://[A-Za-z0-9.:\[\]/_-]+$")]


def _check_root_pem(text: str) -> str:
    from umbra.attest.simpki import cert_der

    try:
        if not text.startswith("-----"):
            raise ValueError
        cert_der(text.encode())
    except ValueError:
        raise ValueError("not a PEM certificate") from None
    return text


SimulatedRootPem = Annotated[str, Field(max_length=8192), AfterValidator(_check_root_pem)]


class DevCvmInputs(Strict):
    """Everything the Dev CVM's host definition (`dev-cvm.json`, sandbox/dev_definition.py)
    depends on. Same inputs, same bytes. The sandbox's addresses and the forwarder's sandbox-side
    ports are not inputs: they are the runc topology's (sandbox/local_cvm.py), the same as
    `umbra up`'s."""

    release: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]{0,62}$")]
    sandbox_image: SandboxImageKeys
    security_cvm: Endpoint
    # The Security CVM's golden values: the forwarder verifies against exactly these, and they are
    # measured with the host definition, so changing them changes the Dev CVM's compose hash.
    security_cvm_release: ReleaseManifest
    # Where the forwarder's collateral for the Security CVM comes from: these PCCS endpoints, or
    # none (the default): the set the Security CVM's tunnel endpoint sends with its quote
    # (`collateral: {relayed: true}`), since a cloud Dev CVM's host ruleset reaches no PCCS.
    pccs_urls: list[PccsUrl] = Field(default_factory=list)
    tunnels: list[Tunnel] = Field(default_factory=list)
    allow_simulated: bool = False
    # With allow_simulated (a `tee: simulated` Security release: CI, the emulated clouds): the
    # simulated root CA (PEM) its quotes chain to, the one anchor the forwarder accepts for them.
    # Measured with the rest, so the compose hash names the root; the dev host writes it where
    # the forwarder's `simulated_root` points at start (without it, something else must put the
    # root there, or the forwarder fails closed). A tee: tdx release cannot allow_simulated.
    simulated_root: SimulatedRootPem | None = None
    # The Console the forwarder enrolls at, once, at first start: the launch data's one-time
    # token and this TD's quote for its tunnel credential (credentials only after attestation).
    # Measured, like the Security CVM's. `console_ca`: the launch data carries the CA the
    # Console's TLS chains to (`umbra-console-ca`); False: a public CA.
    console_url: Annotated[str, Field(pattern=r"^https://[A-Za-z0-9.:\[\]/_-]+$")]
    console_ca: bool = False
    # What the forwarder's enrollment quotes with: configfs-tsm in a TD; `emulated` on the
    # emulated clouds (the host's simulated TDX module over virtio-serial, attest.tdx_port),
    # for a `tee: simulated` release only. Measured: the compose hash says which.
    quote_source: Literal[QuoteSourceKind.configfs, QuoteSourceKind.emulated] = (
        QuoteSourceKind.configfs
    )

    @model_validator(mode="after")
    def _consistent(self) -> DevCvmInputs:
        ports = [t.listen_port for t in self.tunnels]
        if len(set(ports)) != len(ports):
            raise ValueError("tunnel listen ports must be distinct")
        names = [t.name for t in self.tunnels]
        if len(set(names)) != len(names):
            raise ValueError("tunnel names must be distinct")
        if self.simulated_root is not None and not self.allow_simulated:
            raise ValueError("simulated_root is the anchor for allow_simulated: set both")
        return self


class SimulatedQuoteSource(StrEnum):
    simulator = "simulator"
    emulated = "emulated"


class SimulatedQuotes(Strict):
    """A `tee: simulated` release only (development, CI): the proxy quotes with the simulator,
    signed by the simulated PKI the launch directory holds (`simulated-pki/`), with RTMR3 replayed
    from the launch agent's event log. Measured, so the compose hash says so; every production
    verifier refuses the simulated root whatever the compose says."""

    image: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]{0,62}$")] = "umbra-security-cvm"
    # Who signs: the in-container simulator (`simulator`), or the emulated clouds' host TDX
    # module (`emulated`: the image's `--tee emulated` launch agent measured into it, and relays
    # quotes to the proxy through `tdx-quote.sock` in its launch directory).
    source: SimulatedQuoteSource = SimulatedQuoteSource.simulator


class SecurityTestOptions(Strict):
    """`umbra proxy serve`'s test-only options, for a simulated release's test origins on private
    addresses (the proxy prints a loud warning). Refused without `simulated`."""

    allow_upstream: list[ipaddress.IPv4Network] = Field(min_length=1)
    resolver: dict[Host, list[ipaddress.IPv4Address]] = Field(default_factory=dict)
    upstream_ca: Annotated[str, Field(min_length=1, max_length=16384)] | None = None


class SecurityCvmInputs(Strict):
    release: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]{0,62}$")]
    images: SecurityImages
    console_url: Annotated[str, Field(pattern=r"^https://[A-Za-z0-9.:\[\]/_-]+$")]
    # Ed25519 public keys (PEM) pinned for policy bundles: measured, so a compromised Console
    # cannot swap them.
    bundle_keys: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(min_length=1)
    tunnel_port: Port = 8443
    proxy_port: Port = 8080
    # The launch data carries the CA the Console's TLS chains to (`umbra-console-ca`); False: a
    # public CA. Measured, like the Dev CVM's.
    console_ca: bool = False
    # PCCS / Intel PCS endpoints the tunnel endpoint fetches the collateral for its own quote
    # from (through this CVM's egress) and sends with it (`--tunnel-collateral-pccs`): what a
    # Dev CVM whose forwarder has no `pccs_urls` verifies against. Empty: nothing is sent.
    pccs_urls: list[PccsUrl] = Field(default_factory=list)
    simulated: SimulatedQuotes | None = None
    test_options: SecurityTestOptions | None = None

    @model_validator(mode="after")
    def _test_only_when_simulated(self) -> SecurityCvmInputs:
        if self.test_options is not None and self.simulated is None:
            raise ValueError("test_options need simulated quotes (never in a tdx release)")
        if self.tunnel_port == self.proxy_port:
            raise ValueError("tunnel_port and proxy_port must differ")
        return self
