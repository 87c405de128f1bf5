"""Stack configuration: the `umbra:*` keys of `stacks/Pulumi.<stack>.yaml`, validated at program
start. Every failure names the key and what is wrong; callers show `ConfigError` text as is.

Why one module: it is one schema (the stack file's `umbra:*` keys) validated at once; the
cross-field checks and the per-CVM token derivations need every model of it."""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from umbra.attest.measurement import canonical_ssh_key
from umbra.contracts.enrollment import (
    SECURITY_REPLICA_TOKEN_KEY,
    TOKEN_PREFIX,
    dev_token_key,
    security_token_key,
)
from umbra.contracts.model import Strict
from umbra.contracts.web_session_key import decode_web_session_key

NAMESPACE = "umbra"
STACK_KEY = f"{NAMESPACE}:stack"
CONSOLE_DB_PASSWORD_KEY = f"{NAMESPACE}:consoleDbPassword"
# The Console's TLS private key (PEM), with `tls_cert_file`: stored in the cloud's secret store
# for the Console VM (components/console_secrets.py), never in its launch data.
CONSOLE_TLS_KEY_KEY = f"{NAMESPACE}:consoleTlsKey"
# The Console's WEB_SESSION_KEY (base64 of 32 bytes), the same for every replica so a browser's
# login on one is accepted by the others: a secret in the cloud's secret store like the TLS key.
# Required for replicas > 1; unset on one replica, the Console keys its cookies at random.
CONSOLE_WEB_SESSION_KEY_KEY = f"{NAMESPACE}:consoleWebSessionKey"
KNOWN_KEYS = frozenset(
    {STACK_KEY, CONSOLE_DB_PASSWORD_KEY, CONSOLE_TLS_KEY_KEY, CONSOLE_WEB_SESSION_KEY_KEY}
)
# Team stacks: replica i's one-time enrollment token, a Pulumi secret (`umbra cvm security-replica`).
SECURITY_TOKEN_KEY_RE = re.compile(
    "^" + re.escape(SECURITY_REPLICA_TOKEN_KEY).replace(r"\{replica\}", "([0-7])") + "$"
)
# Team stacks: a Dev CVM's one-time enrollment token, a Pulumi secret (`umbra cvm
# enrollment-token ID --token-only`), keyed by developer and CVM name.
DEV_TOKEN_KEY_RE = re.compile(r"^umbra:devEnrollmentToken-[a-z0-9-]+$")
_TOKEN_SHAPE = re.compile("^" + re.escape(TOKEN_PREFIX) + r"[A-Za-z0-9_-]{16,124}$")
# A Console CVM id as the launch agent accepts it for `umbra-cvm-id` (images/launch_agent.py).
ConsoleCvmId = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")]


class ConfigError(Exception):
    """The stack configuration is wrong; the message says which key and why."""


# Short names keep every derived cloud resource name within its limit (GCP service account ids
# are at most 30 characters: "umbra-" + team + "-dev").
Name = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,14}[a-z0-9]$")]


def _ssh_key(line: str) -> str:
    canonical_ssh_key(line)  # raises ValueError naming the bad line
    return line.strip()


def _https(url: str) -> str:
    if not re.fullmatch(r"https://[A-Za-z0-9.-]+(:\d{1,5})?(/[A-Za-z0-9._~/-]*)?", url):
        raise ValueError("must be an https:// URL with a host name (no credentials, no query)")
    return url


def _not_everywhere(net: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
    if net.prefixlen < 8:
        raise ValueError(f"{net} opens the port to (nearly) the whole internet; name your ranges")
    return net


def _public(addr: ipaddress.IPv4Address) -> ipaddress.IPv4Address:
    if not addr.is_global:
        raise ValueError(f"{addr} is not a public address")
    return addr


def console_address_problem(addr: ipaddress.IPv4Address) -> str | None:
    """Why `addr` cannot be a Console address a Dev CVM may dial on 443, or None. The team
    network routes and allows exactly these /32s: a metadata, loopback or broadcast address
    there would open something that is not the Console."""
    if addr.is_unspecified or addr.is_loopback or addr.is_link_local or addr.is_multicast:
        return f"{addr} is not a host the Console can be reached at"
    if addr.is_reserved or addr == ipaddress.IPv4Address("255.255.255.255"):
        return f"{addr} is a reserved address"
    return None


def _console_address(addr: ipaddress.IPv4Address) -> ipaddress.IPv4Address:
    problem = console_address_problem(addr)
    if problem:
        raise ValueError(problem)
    return addr


ConsoleAddress = Annotated[ipaddress.IPv4Address, AfterValidator(_console_address)]
# Team networks: what the policy pack counts as "inside" (Python's `is_private` also counts
# documentation and benchmark ranges, which the internet gateway routes like public ones).
RFC1918 = tuple(ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))
IapMember = Annotated[str, Field(pattern=r"^(user|group|serviceAccount|domain):[^\s]+$")]
PublicAddress = Annotated[ipaddress.IPv4Address, AfterValidator(_public)]
SshKey = Annotated[str, AfterValidator(_ssh_key)]
HttpsUrl = Annotated[str, AfterValidator(_https)]
IngressCidr = Annotated[ipaddress.IPv4Network, AfterValidator(_not_everywhere)]


class GcpPlacement(Strict):
    project: Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")]
    region: Annotated[str, Field(pattern=r"^[a-z]+-[a-z]+\d$")]
    zone: Annotated[str, Field(pattern=r"^[a-z]+-[a-z]+\d-[a-z]$")]

    @model_validator(mode="after")
    def _zone_in_region(self) -> GcpPlacement:
        if not self.zone.startswith(self.region + "-"):
            raise ValueError(f"zone {self.zone!r} is not in region {self.region!r}")
        return self


class AzurePlacement(Strict):
    location: Annotated[str, Field(pattern=r"^[a-z]+[a-z0-9]*$")]
    # Availability zone; DCesv5 is zonal in most regions.
    zone: Literal["1", "2", "3"] | None = None


class NetworkConfig(Strict):
    dev_cidr: ipaddress.IPv4Network
    security_cidr: ipaddress.IPv4Network
    # Who may open the Dev CVM's attested SSH port (e.g. GCP IAP 35.235.240.0/20, a VPN range).
    ssh_ingress_cidrs: list[IngressCidr] = Field(min_length=1)
    # Where the Console is reached when that is not the public internet on 443.
    console_cidrs: list[ipaddress.IPv4Network] = Field(default_factory=list)
    # Public resolvers the Security CVM's proxy uses (udp/tcp 53, through the team's NAT). The
    # team network's own DNS answers no public name (a Dev CVM's lookups are a channel out).
    security_dns_resolvers: list[PublicAddress] = Field(
        default_factory=lambda: [
            ipaddress.IPv4Address("8.8.8.8"),
            ipaddress.IPv4Address("1.1.1.1"),
        ],
        min_length=1,
    )
    # Log denied flows: off by default (a hostile agent can make many, each one billed).
    log_denied: bool = False
    # How a developer's machine reaches the Dev CVM's attested SSH port (8022). No Dev CVM has a
    # public address, so every mode reaches its private one:
    #   private: from ssh_ingress_cidrs only, over a network that routes to the team VPC/VNet
    #   (VPN, Interconnect/ExpressRoute, peering);  iap (GCP): IAP TCP forwarding, with
    #   roles/iap.tunnelResourceAccessor (port 8022 only) granted to iap_members;
    #   bastion (Azure): an Azure Bastion (Standard, native-client tunnelling) in bastion_cidr.
    reachability: Literal["private", "iap", "bastion"] = "private"
    iap_members: list[IapMember] = Field(default_factory=list)
    bastion_cidr: ipaddress.IPv4Network | None = None

    @field_validator("reachability", mode="before")
    @classmethod
    def _no_public(cls, value: object) -> object:
        if value == "public":
            raise ValueError(
                "reachability 'public' is gone: no Dev CVM has a public address, so it reached "
                "nothing; use 'private' (8022 from ssh_ingress_cidrs to the private address, over "
                "your VPN or interconnect), 'iap' (GCP) or 'bastion' (Azure)"
            )
        return value

    @model_validator(mode="after")
    def _reachability(self) -> NetworkConfig:
        if self.reachability == "iap" and not self.iap_members:
            raise ValueError("reachability 'iap' needs iap_members (who may open the tunnel)")
        if self.reachability != "iap" and self.iap_members:
            raise ValueError("iap_members are only used with reachability 'iap'")
        if self.reachability == "bastion":
            net = self.bastion_cidr
            if net is None:
                raise ValueError("reachability 'bastion' needs bastion_cidr (a /26 or larger)")
            if not net.is_private or net.prefixlen > 26:
                raise ValueError(f"bastion_cidr {net} must be a private /26 or larger")
            if net.overlaps(self.dev_cidr) or net.overlaps(self.security_cidr):
                raise ValueError(f"bastion_cidr {net} overlaps dev_cidr or security_cidr")
        elif self.bastion_cidr is not None:
            raise ValueError("bastion_cidr is only used with reachability 'bastion'")
        return self

    @model_validator(mode="after")
    def _disjoint(self) -> NetworkConfig:
        for field, net in (("dev_cidr", self.dev_cidr), ("security_cidr", self.security_cidr)):
            if not any(net.subnet_of(r) for r in RFC1918):
                raise ValueError(
                    f"{field} {net} is not a private range (10/8, 172.16/12, 192.168/16)"
                )
            if net.prefixlen > 28:
                raise ValueError(f"{field} {net} is too small (at most /28)")
        if self.dev_cidr.overlaps(self.security_cidr):
            raise ValueError(
                f"dev_cidr {self.dev_cidr} overlaps security_cidr {self.security_cidr}"
            )
        return self


class CvmConfig(Strict):
    size: str = Field(min_length=1)
    # A TDX-capable image: GCP image self link/family, Azure image id or "publisher:offer:sku:version".
    image: str = Field(min_length=1)
    disk_gb: int = Field(default=50, ge=20, le=2048)
    # The persistent disk kept across replacement (default: Dev CVMs 100 GB, the workspace;
    # Security CVMs 20 GB, the proxy's spool).
    data_disk_gb: int | None = Field(default=None, ge=10, le=65536)
    # Output directory of `umbra image measure DEF --out DIR` (relative to the project root):
    # app-compose.json is delivered, measurement-manifest.json named by its digest.
    # Unset: images/build/<role> if it holds app-compose.json, else a marked placeholder.
    release_dir: str | None = None
    # Overrides the manifest reference: an https:// URL or sha256:<64 hex>.
    measurement_manifest: (
        Annotated[str, Field(pattern=r"^(https://\S+|sha256:[0-9a-f]{64})$")] | None
    ) = None


class SecurityCvmConfig(CvmConfig):
    # Replicas behind the cloud's internal passthrough TCP load balancer on the fixed address;
    # the forwarder attests whichever replica it reaches (they run the same release).
    replicas: int = Field(default=1, ge=1, le=8)
    # Each replica's own Console identity, in replica order: the CVM id `umbra cvm
    # security-replica I` registered (its launch data's `umbra-cvm-id`, bound into its quotes).
    # Replica I's one-time token is the Pulumi secret `umbra:securityEnrollmentToken<I>`, never
    # this document. Unset: the Security CVMs get no token and cannot enroll (a warning).
    cvm_ids: list[ConsoleCvmId] | None = Field(default=None, min_length=1, max_length=8)


class Developer(Strict):
    name: Name
    ssh_keys: list[SshKey] = Field(min_length=1)
    cvms: list[Name] = Field(default_factory=lambda: ["main"], min_length=1)
    size: str | None = None
    # The Console's CVM id of each CVM (by name), registered before `pulumi up`: measured as
    # `umbra.cvm-id` and bound into its enrollment; its token is the secret `dev_token_key`.
    cvm_ids: dict[Name, ConsoleCvmId] = Field(default_factory=dict)

    @field_validator("cvms")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("CVM names must be distinct")
        return v

    @model_validator(mode="after")
    def _ids_name_cvms(self) -> Developer:
        unknown = sorted(set(self.cvm_ids) - set(self.cvms))
        if unknown:
            raise ValueError(f"cvm_ids names CVMs this developer does not have: {unknown}")
        return self


class TeamStack(Strict):
    kind: Literal["team"]
    team: Name
    cloud: Literal["gcp", "azure"]
    gcp: GcpPlacement | None = None
    azure: AzurePlacement | None = None
    # Where the Console is: named here, or read from the Console stack (its `console_url` and
    # `console_ca_pem` outputs) with a StackReference such as "acme-org/umbra/console-gcp".
    console_url: HttpsUrl | None = None
    console_stack: (
        Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+){0,2}$")] | None
    ) = None
    # The Console's address(es) a Dev CVM's forwarder dials to enroll (it has no DNS): its host
    # firewall, the team network (a /32 each, tcp 443 only) and the policy pack's config admit
    # exactly these. Empty: Dev CVMs cannot enroll (the program warns).
    console_ips: list[ConsoleAddress] = Field(default_factory=list, max_length=4)
    network: NetworkConfig
    security_cvm: SecurityCvmConfig
    dev_cvm: CvmConfig
    developers: list[Developer] = Field(default_factory=list)
    # A label on every resource (GCP label value syntax), for billing.
    cost_centre: Annotated[str, Field(pattern=r"^[a-z0-9_-]{1,63}$")] | None = None
    # Per replica, from Pulumi secret config only (parse_stack_config): no document sets it.
    _security_tokens: tuple[str, ...] = PrivateAttr(default=())
    # Per Dev CVM (developer, cvm) -> token, from Pulumi secret config only.
    _dev_tokens: dict[tuple[str, str], str] = PrivateAttr(default_factory=dict)

    def dev_enrollment_token(self, developer: str, cvm: str) -> str | None:
        return self._dev_tokens.get((developer, cvm))

    def with_dev_tokens(self, tokens: dict[tuple[str, str], str]) -> TeamStack:
        self._dev_tokens = tokens
        return self

    def security_enrollment_tokens(self) -> tuple[str, ...]:
        """Replica i's one-time enrollment token at index i (empty: none configured)."""
        return self._security_tokens

    def with_security_tokens(self, tokens: tuple[str, ...]) -> TeamStack:
        self._security_tokens = tokens
        return self

    @model_validator(mode="after")
    def _consistent(self) -> TeamStack:
        _check_placement(self.cloud, self.gcp, self.azure)
        if (self.console_url is None) == (self.console_stack is None):
            raise ValueError("name exactly one of console_url and console_stack")
        replicas = self.security_cvm.replicas
        if replicas > 1:
            room = self.network.security_cidr.num_addresses - 3 - 10
            if replicas > room:
                raise ValueError(
                    f"security_cvm.replicas {replicas} do not fit in security_cidr "
                    f"{self.network.security_cidr} (load balancer at host .10, replicas from .11; "
                    f"at most {room}: use a larger range)"
                )
        ids = self.security_cvm.cvm_ids
        if ids is not None and len(ids) != replicas:
            raise ValueError(
                f"security_cvm.cvm_ids names {len(ids)} CVM(s) for {replicas} replica(s): one "
                "per replica, in order (`umbra cvm security-replica I`)"
            )
        if ids is not None and len(set(ids)) != len(ids):
            raise ValueError("security_cvm.cvm_ids: each replica is its own CVM (ids repeat)")
        mode = self.network.reachability
        if (mode == "iap" and self.cloud != "gcp") or (mode == "bastion" and self.cloud != "azure"):
            raise ValueError(f"network.reachability {mode!r} does not exist on {self.cloud}")
        sizes = [("security_cvm.size", self.security_cvm.size), ("dev_cvm.size", self.dev_cvm.size)]
        sizes += [
            (f"developers[{i}].size", d.size) for i, d in enumerate(self.developers) if d.size
        ]
        for where, size in sizes:
            _check_size(self.cloud, where, size)
        _check_image(self.cloud, "security_cvm.image", self.security_cvm.image)
        _check_image(self.cloud, "dev_cvm.image", self.dev_cvm.image)
        for i, ip in enumerate(self.console_ips):
            for field, net in (
                ("network.dev_cidr", self.network.dev_cidr),
                ("network.security_cidr", self.network.security_cidr),
            ):
                if ip in net:
                    raise ValueError(
                        f"console_ips[{i}] {ip} is inside {field} {net}: the Console is not in "
                        "the team network, and this would open tcp 443 to a team host"
                    )
        if len(set(self.console_ips)) != len(self.console_ips):
            raise ValueError("console_ips lists an address twice")
        names = [d.name for d in self.developers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"developers listed twice: {', '.join(dup)}")
        return self


# Azure Database for PostgreSQL Flexible Server offers these storage sizes only (GiB).
AZURE_DB_STORAGE_GB = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32767)


# Bounded by the database: each replica holds its own connection pool on the one PostgreSQL.
MAX_CONSOLE_REPLICAS = 8


class ConsoleStack(Strict):
    kind: Literal["console"]
    name: Name = "console"
    cloud: Literal["gcp", "azure"]
    gcp: GcpPlacement | None = None
    azure: AzurePlacement | None = None
    cidr: ipaddress.IPv4Network
    # The Console runs in a TDX CVM too: it holds write-only secrets.
    vm: CvmConfig
    console_image: Annotated[
        str, Field(pattern=r"^[a-z0-9.-]+(:\d+)?/[a-z0-9._/-]+@sha256:[0-9a-f]{64}$")
    ]
    ingress_cidrs: list[IngressCidr] = Field(min_length=1)
    db_tier: str = Field(min_length=1)
    # The managed PostgreSQL's storage (GB). Azure Flexible Server: one of its fixed sizes
    # (AZURE_DB_STORAGE_GB), the size (raise it to grow; never shrinks). GCP Cloud SQL: 10-65536,
    # the size it is created with; Cloud SQL's auto-resize grows it from there.
    db_storage_gb: int = Field(default=64, ge=10, le=65536)
    # Console replicas (docs/specs/infra.md "Console replicas"). 1: one VM holding the static
    # address (today's resources, unchanged). >1: GCP a regional managed instance group, Azure N
    # VMs, behind a passthrough TCP load balancer on that address; TLS stays on the VMs.
    replicas: int = Field(default=1, ge=1, le=MAX_CONSOLE_REPLICAS)
    # Exported for team stacks (StackReference): the Console's URL and the CA its TLS chains to
    # (a PEM file relative to the project root; unset when a public CA issues its certificate).
    url: HttpsUrl | None = None
    tls_ca_file: str | None = None
    # The Console's own certificate chain (PEM file relative to the project root), measured in
    # its launch data; its key is the secret `umbra:consoleTlsKey`. Unset: the Console VM's
    # launch agent refuses to start it (a warning at `pulumi up`).
    tls_cert_file: str | None = None
    # GCP: the projects whose Dev CVMs the Console's provisioner launches (default: its own) and
    # the bucket holding the Pulumi state (`pulumi login gs://…`); the Console's service account
    # gets exactly the provisioner's roles there.
    team_projects: list[Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")]] = Field(
        default_factory=list
    )
    state_bucket: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")] | None = (
        None
    )
    # Azure: the same, as team resource group names and the state's storage resource id.
    team_resource_groups: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9._()-]{1,90}$")]] = Field(
        default_factory=list
    )
    state_scope: Annotated[str, Field(pattern=r"^/subscriptions/[^\s]+$")] | None = None
    # Declare the Dev CVM stacks' state (GCP: a bucket, Azure: a blob container) and the key
    # their secrets provider uses (Cloud KMS, Key Vault); exported as dev_state_backend_url /
    # dev_secrets_provider for the Console's settings.
    # Default off: an existing stack declares nothing new.
    dev_state: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> ConsoleStack:
        _check_placement(self.cloud, self.gcp, self.azure)
        _check_size(self.cloud, "vm.size", self.vm.size)
        _check_image(self.cloud, "vm.image", self.vm.image)
        if not self.cidr.is_private or self.cidr.prefixlen > 24:
            raise ValueError(f"cidr {self.cidr} must be a private range of at least /24")
        if self.dev_state and (self.state_bucket or self.state_scope):
            raise ValueError("dev_state declares the state storage: unset state_bucket/state_scope")
        if self.cloud == "azure" and self.db_storage_gb not in AZURE_DB_STORAGE_GB:
            raise ValueError(
                f"db_storage_gb {self.db_storage_gb} is not an Azure Flexible Server size "
                f"({', '.join(map(str, AZURE_DB_STORAGE_GB))})"
            )
        return self


def _check_placement(cloud: str, gcp: GcpPlacement | None, azure: AzurePlacement | None) -> None:
    if cloud == "gcp" and (gcp is None or azure is not None):
        raise ValueError("cloud 'gcp' needs a 'gcp' block and no 'azure' block")
    if cloud == "azure" and (azure is None or gcp is not None):
        raise ValueError("cloud 'azure' needs an 'azure' block and no 'gcp' block")


# TDX machine types only. GCP: C3 standard (c3-standard-N; the TDX-capable C3 shapes, see the
# zones list in docs/specs/infra.md). Azure: DCesv5/DCedsv5/ECesv5/ECedsv5 and DCesv6/ECesv6.
# DCasv5/ECasv5 are AMD SEV-SNP and refused.
GCP_TDX_SIZE = re.compile(r"^c3-standard-(4|8|22|44|88|176)$")
AZURE_TDX_SIZE = re.compile(r"^Standard_[DE]C\d+(ed|e)s_v5$|^Standard_[DE]C\d+es_v6$")


def _check_size(cloud: str, where: str, size: str) -> None:
    if cloud == "gcp" and not GCP_TDX_SIZE.fullmatch(size):
        raise ValueError(
            f"{where} {size!r} is not a TDX machine type (c3-standard-4/8/22/44/88/176)"
        )
    if cloud == "azure" and not AZURE_TDX_SIZE.fullmatch(size):
        raise ValueError(
            f"{where} {size!r} is not a TDX size (DCesv5/DCedsv5/ECesv5/ECedsv5/DCesv6/ECesv6)"
        )


def _check_image(cloud: str, where: str, image: str) -> None:
    if cloud == "azure" and not (
        image.startswith("/") or re.fullmatch(r"[^:\s]+(:[^:\s]+){3}", image)
    ):
        raise ValueError(
            f"{where} {image!r} is neither a resource id nor publisher:offer:sku:version"
        )
    if cloud == "gcp" and not re.fullmatch(r"[a-z0-9/._-]+", image):
        raise ValueError(f"{where} {image!r} is not a GCP image name or self link")


class _Stack(Strict):
    stack: Annotated[TeamStack | ConsoleStack, Field(discriminator="kind")]


StackConfig = TeamStack | ConsoleStack


def _loc(loc: tuple[int | str, ...]) -> str:
    # loc is ("stack", <discriminator branch>, field, ...): the branch is not a key the user wrote.
    if len(loc) > 1 and loc[0] == "stack" and loc[1] in ("team", "console"):
        loc = loc[:1] + loc[2:]
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else f"{NAMESPACE}:{part}"
    return out


def _message(err: Mapping[str, Any]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    msg = str(err["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind == "union_tag_invalid":
        return "kind must be 'team' or 'console'"
    return f"{msg} (got {err['input']!r})" if kind.startswith("string_pattern") else msg


def parse_stack_config(raw: Mapping[str, str], secret_keys: frozenset[str]) -> StackConfig:
    """Validate the stack's `umbra:*` config (values as Pulumi hands them: strings, objects as
    JSON). Raises ConfigError listing every problem, one `key: what` per line."""
    unknown = sorted(
        k
        for k in raw
        if k.startswith(NAMESPACE + ":")
        and k not in KNOWN_KEYS
        and not SECURITY_TOKEN_KEY_RE.match(k)
        and not DEV_TOKEN_KEY_RE.match(k)
    )
    if unknown:
        raise ConfigError(
            "\n".join(f"{k}: unknown key (known: {', '.join(sorted(KNOWN_KEYS))})" for k in unknown)
        )
    text = raw.get(STACK_KEY)
    if text is None:
        raise ConfigError(f"{STACK_KEY}: required key is missing (see docs/specs/infra.md)")
    try:
        doc = json.loads(text)
    except ValueError:
        raise ConfigError(f"{STACK_KEY}: must be a YAML mapping, got a plain string") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{STACK_KEY}: must be a YAML mapping, got {type(doc).__name__}")
    try:
        stack = _Stack.model_validate({"stack": doc}).stack
    except ValidationError as exc:
        lines = [f"{_loc(e['loc'])}: {_message(e)}" for e in exc.errors()]
        raise ConfigError("\n".join(lines)) from None
    if isinstance(stack, ConsoleStack):
        if CONSOLE_DB_PASSWORD_KEY not in raw:
            raise ConfigError(
                f"{CONSOLE_DB_PASSWORD_KEY}: required key is missing "
                f"(set it with `pulumi config set --secret {CONSOLE_DB_PASSWORD_KEY.split(':')[1]}`)"
            )
        if CONSOLE_DB_PASSWORD_KEY not in secret_keys:
            raise ConfigError(
                f"{CONSOLE_DB_PASSWORD_KEY}: stored in plain text; set it with `pulumi config set --secret`"
            )
        if len(raw[CONSOLE_DB_PASSWORD_KEY]) < 16:
            raise ConfigError(f"{CONSOLE_DB_PASSWORD_KEY}: must be at least 16 characters")
        if (stack.tls_cert_file is None) != (CONSOLE_TLS_KEY_KEY not in raw):
            raise ConfigError(
                f"{CONSOLE_TLS_KEY_KEY} and umbra:stack.tls_cert_file come together "
                f"(set the key with `pulumi config set --secret {CONSOLE_TLS_KEY_KEY.split(':')[1]} "
                "< key.pem`)"
            )
        if CONSOLE_TLS_KEY_KEY in raw and CONSOLE_TLS_KEY_KEY not in secret_keys:
            raise ConfigError(
                f"{CONSOLE_TLS_KEY_KEY}: stored in plain text; set it with `pulumi config set --secret`"
            )
        _check_web_session_key(stack, raw, secret_keys)
        if any(SECURITY_TOKEN_KEY_RE.match(k) or DEV_TOKEN_KEY_RE.match(k) for k in raw):
            raise ConfigError("enrollment token keys belong to team stacks")
        return stack
    stack = stack.with_security_tokens(_security_tokens(stack, raw, secret_keys))
    return stack.with_dev_tokens(_dev_tokens(stack, raw, secret_keys))


def _check_web_session_key(
    stack: ConsoleStack, raw: Mapping[str, str], secret_keys: frozenset[str]
) -> None:
    """Required for replicas > 1 (each would otherwise key cookies at random), a secret, and what
    the Console's WEB_SESSION_KEY validator takes (base64 of 32 bytes); named, never echoed."""
    key = CONSOLE_WEB_SESSION_KEY_KEY
    how = f"set it with `head -c 32 /dev/urandom | base64 | pulumi config set --secret {key.split(':')[1]}`"
    value = raw.get(key)
    if value is None:
        if stack.replicas > 1:
            raise ConfigError(
                f"{key}: required with replicas {stack.replicas} (a browser's login must be "
                f"accepted by every replica); {how}"
            )
        return
    if key not in secret_keys:
        raise ConfigError(f"{key}: stored in plain text; {how}")
    try:
        decode_web_session_key(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc} (want base64 of 32 bytes); {how}") from None


def _dev_tokens(
    stack: TeamStack, raw: Mapping[str, str], secret_keys: frozenset[str]
) -> dict[tuple[str, str], str]:
    """Each team-stack Dev CVM's token: required exactly for the CVMs with a Console id, a
    secret, token-shaped; every problem named by key, never by value."""
    expected = {dev_token_key(d.name, c): (d.name, c) for d in stack.developers for c in d.cvm_ids}
    problems: list[str] = []
    for key in sorted(k for k in raw if DEV_TOKEN_KEY_RE.match(k)):
        if key not in expected:
            problems.append(f"{key}: no developers[].cvm_ids entry for this developer and CVM")
        elif key not in secret_keys:
            problems.append(
                f"{key}: stored in plain text; set it with `pulumi config set --secret`"
            )
        elif not _TOKEN_SHAPE.match(raw[key].strip()):
            problems.append(
                f"{key}: not an enrollment token (`umbra cvm enrollment-token ID --token-only`)"
            )
    for key in sorted(set(expected) - set(raw)):
        problems.append(
            f"{key}: required key is missing (the CVM has a Console id: `umbra cvm "
            f"enrollment-token ID --token-only | pulumi config set --secret {key.split(':', 1)[1]}`)"
        )
    if problems:
        raise ConfigError("\n".join(problems))
    return {pair: raw[key].strip() for key, pair in expected.items()}


def _security_tokens(
    stack: TeamStack, raw: Mapping[str, str], secret_keys: frozenset[str]
) -> tuple[str, ...]:
    """Each replica's token from its secret key; every problem named by key, never by value."""
    replicas, ids = stack.security_cvm.replicas, stack.security_cvm.cvm_ids
    problems: list[str] = []
    given = {int(m.group(1)): k for k in raw if (m := SECURITY_TOKEN_KEY_RE.match(k))}
    for index, key in sorted(given.items()):
        if index >= replicas:
            problems.append(
                f"{key}: there is no replica {index} (security_cvm.replicas {replicas})"
            )
        elif key not in secret_keys:
            problems.append(
                f"{key}: stored in plain text; set it with `pulumi config set --secret`"
            )
        elif not _TOKEN_SHAPE.match(raw[key].strip()):
            problems.append(
                f"{key}: not an enrollment token (`umbra cvm security-replica {index} --token-only`)"
            )
    if given and ids is None:
        problems.append(
            f"{STACK_KEY}.security_cvm.cvm_ids: required with enrollment tokens (the CVM ids "
            "`umbra cvm security-replica I` registered)"
        )
    if ids is not None:
        for index in range(replicas):
            if index not in given:
                key = security_token_key(index)
                problems.append(
                    f"{key}: required key is missing (`umbra cvm security-replica {index} "
                    f"--token-only | pulumi config set --secret {key.split(':', 1)[1]}`)"
                )
    if problems:
        raise ConfigError("\n".join(problems))
    if ids is None:
        return ()
    return tuple(raw[given[index]].strip() for index in range(replicas))
