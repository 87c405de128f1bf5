"""The proxy's options, declared once: `ProxyConfig`'s fields carry a `Flag` saying how each is
given on `umbra proxy serve` and what it means.

`cli/proxy.py` builds the command's options from these declarations, and the options table in
`docs/specs/proxy.md` is generated from them (`spec_table`; a test fails when the file differs).
Only pydantic here: `umbra --help` must not import mitmproxy.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Self, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

DEFAULT_MAX_BODY = 32 << 20
_PCCS_URL = re.compile(r"^https?://[A-Za-z0-9.:\[\]/_-]+$")
QuoteSource = Literal["configfs", "azure", "simulated", "emulated"]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclass(frozen=True)
class Flag:
    """How a field is given on the command line.

    `help` is the command's help text; `doc` is the spec table's text where it says more. A
    HOST:PORT flag sets two fields: the one it is declared on (the host) and `port_field`."""

    help: str
    doc: str = ""
    flag: str = ""  # default: --field-name
    metavar: str = ""
    port_field: str = ""
    cli_default: Any = UNSET  # where the command's default differs from the model's


@dataclass(frozen=True)
class Option:
    """One command-line option, resolved from a field (or a command-only declaration)."""

    field: str
    flag: Flag
    annotation: Any
    default: Any

    @property
    def name(self) -> str:
        return self.flag.flag or "--" + self.field.replace("_", "-")

    @property
    def param(self) -> str:
        """The command function's parameter name (click's, derived from the flag)."""
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def choices(self) -> tuple[str, ...]:
        return _literal_choices(self.annotation)


def _literal_choices(annotation: Any) -> tuple[str, ...]:
    if getattr(annotation, "__origin__", None) is Literal:
        return tuple(str(choice) for choice in get_args(annotation))
    return ()


class ProxyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    listen_host: Annotated[
        str,
        Flag(
            "HOST:PORT to accept tunnel connections on.",
            "the proxy's own listener (port 0: any free port; the chosen one is printed); with "
            "`--tunnel-listen` it must be loopback",
            flag="--listen",
            metavar="HOST:PORT",
            port_field="listen_port",
            cli_default="127.0.0.1:8080",
        ),
    ] = "127.0.0.1"
    listen_port: int = Field(default=8080, ge=0, le=65535)
    tunnel_listen_host: Annotated[
        str | None,
        Flag(
            "HOST:PORT of the aTLS tunnel endpoint for Dev CVM forwarders (same process).",
            "run the aTLS tunnel endpoint in the same process (see Tunnel endpoint)",
            flag="--tunnel-listen",
            metavar="HOST:PORT",
            port_field="tunnel_listen_port",
        ),
    ] = None
    tunnel_listen_port: int = Field(default=8443, ge=0, le=65535)
    quote_source: Annotated[
        QuoteSource,
        Flag(
            "Tunnel endpoint quotes: configfs (the TD's configfs-tsm), azure (vTPM + IMDS under "
            "the paravisor) or simulated.",
            "`configfs` (the TD's configfs-tsm, production on GCP), `azure` (the vTPM HCL report "
            "+ IMDS TD quote as one Azure evidence envelope, production on Azure; no event log: "
            "the guest cannot extend RTMRs under the paravisor), `emulated` (an emulated-cloud "
            "VM: the host's simulated TDX module through `--tdx-quote-socket`) or `simulated` "
            "(embedded default, tests)",
            metavar="SOURCE",
        ),
    ] = "configfs"
    event_log: Annotated[
        Path | None,
        Flag(
            "Event log (dstack JSON or CCEL) served with the endpoint's quotes.",
            "event log (dstack JSON or CCEL) sent with every quote; forwarders replay it against "
            "the RTMRs",
            metavar="FILE",
        ),
    ] = None
    simulated_pki: Annotated[
        Path | None,
        Flag(
            "SIMULATED TEE only: the simulated PKI directory that signs quotes.",
            "simulated TEE only: the PKI that signs quotes",
            metavar="DIR",
        ),
    ] = None
    tdx_quote_socket: Annotated[
        Path | None,
        Flag(
            "EMULATED TEE only: the launch agent's TDX quote relay socket.",
            "emulated clouds only: the launch agent's quote relay to the host's simulated TDX "
            "module",
            metavar="FILE",
        ),
    ] = None
    simulated_image: Annotated[
        str,
        Flag(
            "SIMULATED TEE only: the simulated image name.",
            "simulated TEE only: the image name the simulated quotes measure",
        ),
    ] = "umbra-security-cvm"
    tunnel_header_timeout: Annotated[
        float,
        Flag(
            "Seconds a tunnel may take to send its identity header.",
            "seconds an attested session may take to send its identity header",
        ),
    ] = Field(default=10.0, gt=0)
    tunnel_collateral_pccs: Annotated[
        list[str],
        Flag(
            "PCCS / Intel PCS URL the tunnel endpoint fetches its own collateral from (repeat).",
            "the tunnel endpoint sends the Intel-signed collateral for its own quote with it, "
            "fetched from these PCCS / PCS URLs in turn through this CVM's egress and renewed "
            "before it lapses, so a forwarder that reaches no PCCS verifies it (see Tunnel "
            "endpoint)",
            metavar="URL",
        ),
    ] = Field(default_factory=list)
    policy_dir: Annotated[
        Path | None,
        Flag(
            "Local mode: enforce this policy directory (unsigned).",
            "local mode: enforce a policy directory (unsigned, development only)",
        ),
    ] = None
    bundle: Annotated[
        Path | None,
        Flag(
            "Enforce this signed bundle file.",
            "enforce a signed bundle file, verified against the pinned `--bundle-key`(s)",
        ),
    ] = None
    bundle_keys: Annotated[
        list[Path],
        Flag(
            "Pinned Ed25519 public key (PEM) bundles must be signed by; repeatable.",
            "pinned Ed25519 public key (PEM) that bundles (file or Console) must be signed by; "
            "repeatable",
            flag="--bundle-key",
        ),
    ] = Field(default_factory=list)
    console_url: Annotated[
        str | None,
        Flag(
            "Console base URL: pull bundle and attachments, ship the traffic log.",
            "pull bundle and attachments from the Console, ship the traffic log to it (needs "
            "`--security-cvm-id`, `--console-credential-file` and `--bundle-key`)",
            flag="--console",
            metavar="URL",
        ),
    ] = None
    security_cvm_id: Annotated[str | None, Flag("This Security CVM's id at the Console.")] = None
    # The bearer credential the Console issued this Security CVM when it enrolled (proxy/enroll.py).
    console_credential_file: Annotated[
        Path | None,
        Flag(
            "File holding the bearer credential the Console issued this Security CVM.",
            "every Console call carries `Authorization: Bearer <credential>` (issued to this "
            "Security CVM when it enrolled, or by an admin); the proxy refuses to start in Console "
            "mode without it",
        ),
    ] = None
    # A private Console CA (launch data's `umbra-console-ca`); absent: the public CAs (certifi).
    console_ca: Annotated[
        Path | None,
        Flag(
            "CA (PEM) the Console's TLS certificate chains to, instead of the public CAs.",
            "the CA (PEM) the Console's TLS chains to, for every Console call (enrollment, "
            "bundle, attachments, secrets, traffic log); the launch agent writes it from launch "
            "data (`umbra-console-ca`); absent: the public CAs",
            metavar="FILE",
        ),
    ] = None
    enroll_token_file: Annotated[
        Path | None,
        Flag(
            "The one-time enrollment token from launch data: with no credential in "
            "--console-credential-file yet, enroll (attested) and store the credential there.",
            "the one-time enrollment token from launch data (`/run/umbra/launch/enrollment-token`"
            "): with no credential in `--console-credential-file` yet, the proxy enrolls once at "
            "start, before any worker (`proxy/enroll.py`: a key generated here, a quote from "
            "`--quote-source` binding it, the credential HPKE-sealed to it) and stores the "
            "credential there 0600; a stored credential is used as is; a lost credential with "
            "the same, spent token is refused locally (mint a new token). See embedded.md",
            metavar="FILE",
        ),
    ] = None
    state_dir: Annotated[
        Path | None,
        Flag(
            "Where the last good bundle is cached.",
            "last good bundle and attachments, re-verified at start-up",
        ),
    ] = None
    identities: Annotated[
        Path,
        Flag(
            "Identities file: CVM ids, owners, teams, profiles, tunnel credentials/source ranges.",
            "which tunnel credential / source range is which CVM (see Identity)",
            cli_default=Path("identities.yaml"),
        ),
    ]
    secrets: Annotated[
        Path | None,
        Flag(
            "Local mode secrets file (YAML/JSON, mode 0600).",
            "local-mode secrets file (mode 0600): `team: {name: value}`, "
            "`personal: {owner: {name: value}}`",
        ),
    ] = None
    # Take injection secrets from the Console's attested release instead of a local file.
    secrets_from_console: Annotated[
        bool,
        Flag(
            "Take injection secrets from the Console's attested release (needs --console).",
            "production: secrets come from the Console's attested release (needs `--console`, "
            "no `--secrets`; quotes from `--quote-source`)",
        ),
    ] = False
    secrets_interval: float = Field(default=300.0, gt=0)
    traffic_log: Annotated[
        Path,
        Flag(
            "Traffic-log spool directory (append-only JSON lines).",
            "spool directory of the traffic log",
            cli_default=Path("traffic-spool"),
        ),
    ]
    confdir: Annotated[
        Path,
        Flag(
            "Directory of the proxy's interception CA (created if missing).",
            "the interception CA the sandboxes trust (`mitmproxy-ca-cert.pem`, created if missing)",
            cli_default=Path("mitm-ca"),
        ),
    ]
    upstream_ca: Annotated[
        Path | None,
        Flag(
            "Trust this CA (PEM) for upstream TLS instead of the system store (tests).",
            "trust this CA for upstream TLS instead of the system store (tests)",
        ),
    ] = None
    max_body: Annotated[
        int,
        Flag(
            "Largest request body scanned and forwarded, in bytes; larger gets 413.",
            "largest request body buffered, scanned and forwarded, in bytes (larger: 413); "
            "responses are never limited (they stream)",
        ),
    ] = Field(default=DEFAULT_MAX_BODY, ge=1024)
    # Worker processes sharing the listen (and tunnel) port through SO_REUSEPORT.
    workers: Annotated[
        int,
        Flag(
            "Proxy worker processes sharing the listen port (SO_REUSEPORT); default: cores.",
            "proxy worker processes on the one listen port (0: the core count; see Workers)",
            metavar="N",
            cli_default=0,
        ),
    ] = Field(default=1, ge=1, le=256)
    test_allow_upstream: Annotated[
        list[str],
        Flag(
            "TEST ONLY: allow dialling this CIDR (e.g. 127.0.0.1/32). Never in production.",
            "**test only**: admit these upstream addresses (loopback origins); prints a loud "
            "warning",
            metavar="CIDR",
        ),
    ] = Field(default_factory=list)
    test_resolver: Annotated[
        Path | None,
        Flag(
            "TEST ONLY: resolve names from this JSON map instead of DNS.",
            "**test only**: resolve names from a JSON map (`name: [addr]` or "
            "`name: [[answer1], [answer2]]` for rebinding)",
            metavar="FILE",
        ),
    ] = None
    test_hosts: Annotated[
        Path | None,
        Flag(
            "TEST ONLY: these names from a JSON map, every other name from DNS (embedded mode).",
            "**test only**: the names of a JSON map (as `--test-resolver`) resolve from it, every "
            "other name through the system resolver; every address is checked either way "
            "(`umbra up`: the stand-in origin is the one static name)",
            metavar="FILE",
        ),
    ] = None
    test_clock: Annotated[
        Path | None,
        Flag(
            "TEST ONLY: budget windows read the time plus the seconds in this file.",
            "**test only**: budget windows (Budgets) read the time plus the number of seconds "
            "in this file, read at each use (a test moves to the next minute or day without "
            "waiting)",
            metavar="FILE",
        ),
    ] = None
    poll_interval: float = Field(default=0.5, gt=0)
    ship_interval: float = Field(default=1.0, gt=0)
    # Set by the supervisor for each worker it starts; None in a single-process proxy.
    worker_index: int | None = Field(default=None, ge=0)

    @property
    def spool_dir(self) -> Path:
        """Each worker spools (and ships) on its own."""
        if self.worker_index is None:
            return self.traffic_log
        return self.traffic_log / f"worker-{self.worker_index}"

    @property
    def worker_state_dir(self) -> Path | None:
        if self.state_dir is None or self.worker_index is None:
            return self.state_dir
        return self.state_dir / f"worker-{self.worker_index}"

    @model_validator(mode="after")
    def _one_policy_source(self) -> Self:
        sources = [
            self.policy_dir is not None,
            self.bundle is not None,
            self.console_url is not None,
        ]
        if sum(sources) != 1:
            raise ValueError("give exactly one of --policy-dir, --bundle or --console")
        if (self.bundle or self.console_url) and not self.bundle_keys:
            raise ValueError("--bundle and --console need at least one pinned --bundle-key")
        if self.console_url and not self.security_cvm_id:
            raise ValueError("--console needs --security-cvm-id")
        if self.console_url and self.console_credential_file is None:
            raise ValueError("--console needs --console-credential-file")
        if self.console_ca is not None and self.console_url is None:
            raise ValueError("--console-ca needs --console")
        if self.enroll_token_file is not None and self.console_url is None:
            raise ValueError("--enroll-token-file needs --console")
        if self.secrets_from_console and (self.console_url is None or self.secrets is not None):
            raise ValueError("--secrets-from-console needs --console and no --secrets file")
        if self.tunnel_listen_host is not None and not is_loopback(self.listen_host):
            # The endpoint registers loopback sources; a proxy listener others can reach would
            # accept connections the endpoint never authenticated.
            raise ValueError("with --tunnel-listen, --listen must be a loopback address")
        if self.tunnel_collateral_pccs and self.tunnel_listen_host is None:
            raise ValueError("--tunnel-collateral-pccs needs --tunnel-listen")
        for url in self.tunnel_collateral_pccs:
            if not _PCCS_URL.match(url):
                raise ValueError(f"--tunnel-collateral-pccs {url[:80]!r} is not an http(s) URL")
        if self.workers > 1 and (
            self.listen_port == 0
            or (self.tunnel_listen_host is not None and self.tunnel_listen_port == 0)
        ):
            raise ValueError("--workers above 1 needs fixed --listen and --tunnel-listen ports")
        for cidr in self.test_allow_upstream:
            ipaddress.ip_network(cidr, strict=True)
        if self.test_resolver is not None and self.test_hosts is not None:
            raise ValueError("give at most one of --test-resolver and --test-hosts")
        return self


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Options of the command that are not configuration: resolved by `umbra proxy serve` itself.
COMMAND_ONLY = (
    Option(
        "security_cvm_id_file",
        Flag(
            "Read this Security CVM's id from a (launch-bound) file.",
            "read `--security-cvm-id` from a launch-bound file",
            metavar="FILE",
        ),
        Path | None,
        None,
    ),
)


def _flag(info: FieldInfo) -> Flag | None:
    return next((item for item in info.metadata if isinstance(item, Flag)), None)


def options() -> Iterator[Option]:
    """Every option of `umbra proxy serve`, in declaration order."""
    for name, info in ProxyConfig.model_fields.items():
        flag = _flag(info)
        if flag is None:
            continue
        if flag.cli_default is not UNSET:
            default = flag.cli_default
        elif info.default_factory is not None:
            default = None  # a repeatable option given no times
        else:
            default = info.default
        yield Option(name, flag, info.annotation, default)
    yield from COMMAND_ONLY


def _shown(option: Option) -> str:
    default = option.default
    if default is None or default is False or default == []:
        return ""
    if option.flag.port_field:
        return f"`{default}`"
    if option.field == "max_body":
        return f"`{default}` ({default >> 20} MiB)"
    return f"`{default}`"


def spec_table() -> str:
    """The options table of `docs/specs/proxy.md`, generated from the declarations."""
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for option in options():
        flag = option.name + (f" {option.flag.metavar}" if option.flag.metavar else "")
        lines.append(f"| `{flag}` | {_shown(option)} | {option.flag.doc or option.flag.help} |")
    return "\n".join(lines) + "\n"


SPEC_BEGIN = "<!-- options: generated by `python -m umbra.proxy.config`; edit proxy/config.py -->\n"
SPEC_END = "<!-- options: end -->\n"


def with_spec_table(text: str) -> str:
    """`text` (the spec) with its options table replaced by the generated one."""
    head, _, rest = text.partition(SPEC_BEGIN)
    _, found, tail = rest.partition(SPEC_END)
    if not found:
        raise ValueError("the spec has no options table markers")
    return head + SPEC_BEGIN + spec_table() + SPEC_END + tail


if __name__ == "__main__":
    # Regenerate the table in place: python -m umbra.proxy.config docs/specs/proxy.md
    for path in map(Path, sys.argv[1:]):
        path.write_text(with_spec_table(path.read_text()))
