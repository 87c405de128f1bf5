"""`umbra up`'s machinery: the embedded stack as real processes supervised from a state directory.

    .umbra/
      up.lock            held while an `umbra up`/`down` runs (a second one is refused)
      state.json         ports, ids of the team's Security CVM and Dev CVM
      run/NAME.pid       one per component; each process carries UMBRA_UP_STATE=<dir> in its
                         environment, so a recycled pid is never mistaken for ours
      logs/NAME.log      stdout+stderr of each component; logs/up.log: each run's steps, timestamped
      keys/, pki/, ...   development keys, the simulated TEE's PKI, the demo origin's CA
      cvms/ID/           local Dev CVMs (sandbox/local_cvm.py)

Components: the development OIDC issuer, the Console (SQLite, migrated at start, embedded mode),
the Security CVM (`umbra proxy serve` with its aTLS tunnel endpoint on the simulated TEE) and the
walkthrough's stand-in origin. The Dev CVM is launched through the Console's API exactly as
`umbra cvm launch` does; the Console's local provider builds it.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import fcntl
import hashlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from umbra.sandbox import local_cvm
from umbra.sandbox.render import CA_NAME

TEAM = "local"
SUBJECT = "developer@umbra.local"
DEV_CVM_NAME = "dev"
SECURITY_CVM_NAME = "security"
DEMO_SECRET_NAME = "demo-token"  # noqa: S105 -- a secret's name, not its value
DEMO_HOSTS = ("api.demo.test", "evil.demo.test")
# The stand-in model API that `--check` runs the real agents against (cli/llm_origin.py).
LLM_HOST = "llm.demo.test"
SIMULATED_IMAGE = "umbra-security-cvm"
COMPONENTS = ("issuer", "console", "origin", "llm", "proxy")
# `--internet`: what `pip download` and `git ls-remote` use. UMBRA_UP_INTERNET_TARGETS (JSON,
# the same keys) points them elsewhere: a mirror, or the stand-in origin in the wiring test.
INTERNET_TARGETS = {
    "pypi_index": "https://pypi.org/simple",
    "pypi_files": "https://files.pythonhosted.org",
    "package": "requests",
    "git_url": "https://github.com/git/git",
}
SYSTEM_CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
# Attached to the Dev CVM when the bundle has them: the walkthrough's origin and daily work
# (Python, npm, Debian, public git; policies/tests/daily-work.yaml).
DEFAULT_PROFILES = (
    "demo", "pypi", "npm", "debian", "git-public", "anthropic-standin", "openai-standin",
)  # fmt: skip
# The hosts of those profiles: resolved once at `up` only to find a network's own mirror (a
# non-public address the proxy would refuse), which this embedded stack then allows, with a
# warning. The proxy itself resolves every name live with the system resolver.
DAILY_HOSTS = (
    "pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "deb.debian.org",
    "security.debian.org", "github.com", "gitlab.com",
)  # fmt: skip
# Offsets from --port-base.
PORTS = {"issuer": 0, "console": 1, "proxy": 2, "tunnel": 3, "origin": 4, "llm": 5}
REQUIRED_TOOLS = {
    "ip": "iproute2",
    "nft": "nftables",
    "nsenter": "util-linux",
    "curl": "curl",
    # The attested SSH path: the gateway sshd, the client, host/login keys, agent sessions.
    "sshd": "openssh-server",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "dtach": "dtach",
    # The sandbox: its runtime, and what builds its image once (sandbox/image.py).
    "runc": "runc",
    "mmdebstrap": "mmdebstrap",
    "npm": "npm",
}


class UpError(Exception):
    """One clear message (what and why) and the fix."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix


@dataclass
class Stack:
    state_dir: Path
    port_base: int
    progress: Callable[[str], None] = print
    state: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ paths and state
    def p(self, *parts: str) -> Path:
        return self.state_dir.joinpath(*parts)

    def load(self) -> None:
        try:
            self.state = json.loads(self.p("state.json").read_text())
        except (OSError, ValueError):
            self.state = {}
        self.port_base = int(self.state.get("port_base", self.port_base))

    def save(self) -> None:
        self.state["port_base"] = self.port_base
        temp = self.p("state.json.tmp")
        temp.write_text(json.dumps(self.state, indent=2))
        os.replace(temp, self.p("state.json"))

    def port(self, name: str) -> int:
        return self.port_base + PORTS[name]

    @property
    def console_url(self) -> str:
        return f"http://127.0.0.1:{self.port('console')}"

    @property
    def issuer_url(self) -> str:
        return f"http://127.0.0.1:{self.port('issuer')}"

    # ------------------------------------------------------------------ locking
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        handle = self.p("up.lock").open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            handle.close()
            raise UpError(
                f"another `umbra up` or `umbra down` is running on {self.state_dir} (pid {holder})",
                "wait for it to finish, or stop it",
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            handle.close()

    # ------------------------------------------------------------------ processes
    def pid(self, name: str) -> int | None:
        try:
            pid = int(self.p("run", f"{name}.pid").read_text())
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (OSError, ValueError):
            return None
        if f"UMBRA_UP_STATE={self.state_dir}".encode() not in environ.split(b"\0"):
            return None
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return None
        return pid

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        self.p("run").mkdir(exist_ok=True)
        self.p("logs").mkdir(exist_ok=True)
        log = self.p("logs", f"{name}.log").open("ab")
        full_env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": os.environ.get("HOME", "/root"),
            **(env or {}),
            "UMBRA_UP_STATE": str(self.state_dir),
        }
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=full_env,
            cwd=self.state_dir,
            start_new_session=True,
        )
        log.close()
        self.p("run", f"{name}.pid").write_text(str(proc.pid))
        # Until it has exec'd, the child still shows our environment (without the marker).
        end = time.monotonic() + 10
        while self.pid(name) is None and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.01)
        return proc.pid

    def stop(self, name: str) -> bool:
        pid = self.pid(name)
        if pid is None:
            self.p("run", f"{name}.pid").unlink(missing_ok=True)
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        end = time.monotonic() + 5
        while time.monotonic() < end and self.pid(name) is not None:
            time.sleep(0.05)
        if self.pid(name) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            time.sleep(0.1)
        self.p("run", f"{name}.pid").unlink(missing_ok=True)
        return True

    def reap_orphans(self) -> list[int]:
        """Kill what is left of a component whose main process died (kill -9 leaves its children
        holding its ports): any process carrying our marker outside a live component's group."""
        live = {pid for name in COMPONENTS if (pid := self.pid(name)) is not None}
        marker = f"UMBRA_UP_STATE={self.state_dir}".encode()
        reaped = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if marker not in (proc / "environ").read_bytes().split(b"\0"):
                    continue
                pgid = os.getpgid(int(proc.name))
            except (OSError, ProcessLookupError):
                continue
            if pgid not in live:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(proc.name), signal.SIGKILL)
                    reaped.append(int(proc.name))
        if reaped:
            time.sleep(0.2)
        return reaped

    def wait_http(self, name: str, url: str, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.pid(name) is None:
                raise UpError(f"{name} exited while starting: {self.log_tail(name)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise UpError(f"{name} did not answer {url} within {timeout:.0f}s: {self.log_tail(name)}")

    def wait_tcp(self, name: str, port: int, timeout: float = 90) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.pid(name) is None:
                raise UpError(f"{name} exited while starting: {self.log_tail(name)}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return
            time.sleep(0.1)
        raise UpError(f"{name} did not listen on port {port} within {timeout:.0f}s")

    def log_tail(self, name: str, chars: int = 600) -> str:
        with contextlib.suppress(OSError):
            return self.p("logs", f"{name}.log").read_text(errors="replace")[-chars:].strip()
        return "(no log)"


# ---------------------------------------------------------------------- preflight


def preflight(stack: Stack) -> None:
    if os.geteuid() != 0:
        raise UpError(
            "umbra up needs root: it creates network and user namespaces for the Dev CVM",
            "run it as root (sudo ./scripts/up)",
        )
    missing = sorted({pkg for tool, pkg in REQUIRED_TOOLS.items() if shutil.which(tool) is None})
    if missing:
        raise UpError(
            f"missing system packages: {', '.join(missing)}", "run ./scripts/system-deps as root"
        )
    stack.reap_orphans()
    for name in PORTS:
        if name in ("tunnel",) or stack.pid(_owner_of(name)) is not None:
            continue
        with socket.socket() as sock:
            # As the servers do: TIME_WAIT leftovers of a killed component do not count.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", stack.port(name)))
            except OSError:
                raise UpError(
                    f"port {stack.port(name)} ({name}) is in use by another program",
                    "stop that program, or pick other ports with --port-base",
                ) from None


def _owner_of(port_name: str) -> str:
    return "proxy" if port_name == "tunnel" else port_name


# ---------------------------------------------------------------------- one-time material


def _pem_cert(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    data: bytes = cert.public_bytes(serialization.Encoding.PEM)
    return data


_ORIGIN_NAMES = frozenset({*DEMO_HOSTS, LLM_HOST})


def _names(cert: Path) -> set[str]:
    """The DNS names a stand-in certificate covers (an older state dir's may lack one)."""
    from cryptography import x509

    try:
        parsed = x509.load_pem_x509_certificate(cert.read_bytes())
        sans = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (OSError, ValueError, x509.ExtensionNotFound):
        return set()
    return set(sans.value.get_values_for_type(x509.DNSName))


def _demo_ca(directory: Path) -> None:
    """A CA of its own for the stand-in origin, and the origin's certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if (directory / "origin.pem").exists() and _names(directory / "origin.pem") >= _ORIGIN_NAMES:
        return
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Umbra demo origin CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(h) for h in sorted(_ORIGIN_NAMES)]
    sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, DEMO_HOSTS[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=300))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (directory / "ca.pem").write_bytes(_pem_cert(ca))
    key_path = directory / "origin-key.pem"
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    (directory / "origin.pem").write_bytes(_pem_cert(cert))


def _write_secret(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def prepare_material(stack: Stack) -> None:
    """Keys, the simulated TEE, golden values and config files; made once, reused after."""
    from umbra.attest.simpki import SimulatedPki
    from umbra.attest.simulator import SimulatedTdx
    from umbra.contracts.keys import write_key_pair
    from umbra.contracts.session import CVM_ID_EVENT
    from umbra.policy.bundle import generate_key

    keys = stack.p("keys")
    keys.mkdir(exist_ok=True, mode=0o700)
    release_key = keys / "dev-release.pem"
    if not release_key.exists():
        write_key_pair(generate_key(), release_key)
    kek = keys / "console-kek"
    if not kek.exists():
        _write_secret(kek, f"k1={base64.b64encode(os.urandom(32)).decode()}\n".encode())
    pki = SimulatedPki.load_or_create(stack.p("pki"))
    # Collateral is dated: refreshed on every `umbra up` so it never expires under a long run.
    stack.p("pki", "collateral.json").write_text(pki.collateral(int(time.time()) - 3600).json_text)
    stack.p("pki", "root.der").write_bytes(pki.root_der)
    release = SimulatedTdx(pki, image=SIMULATED_IMAGE).release_manifest()
    release_doc = release.model_dump(mode="json", exclude_none=True)
    stack.p("security-cvm").mkdir(exist_ok=True, mode=0o700)
    stack.p("security-cvm", "release.json").write_text(json.dumps(release_doc, indent=2))
    _demo_ca(stack.p("demo-origin"))
    # The proxy resolves real names with the system resolver; the stand-in origin's names are
    # the one static exception (`--test-hosts`).
    resolver: dict[str, list[str]] = {host: ["127.0.0.1"] for host in sorted(_ORIGIN_NAMES)}
    stack.p("security-cvm", "resolver.json").write_text(json.dumps(resolver))
    hosts = sorted(set(DAILY_HOSTS) | set(internet_hosts()))
    found, unresolved = _resolve_now([h for h in hosts if h not in resolver])
    stack.state["mirrors"] = {
        host: [a for a in addresses if not ipaddress.ip_address(a).is_global]
        for host, addresses in found.items()
        if any(not ipaddress.ip_address(a).is_global for a in addresses)
    }
    stack.state["internet_unresolved"] = unresolved
    _upstream_trust(stack)
    dev_release = SimulatedTdx(pki, image=local_cvm.DEV_CVM_IMAGE).release_manifest(
        events=[{"name": CVM_ID_EVENT}]
    )
    dev_release_doc = dev_release.model_dump(mode="json", exclude_none=True)
    # The Console verifies each Dev CVM's enrollment quote against this release (its own).
    stack.p("dev-cvm-release.json").write_text(json.dumps(dev_release_doc, indent=2))
    identities = stack.p("security-cvm", "identities.json")
    if not identities.exists():
        # Empty: Dev CVMs are known from the Console's attachments once they enrolled.
        identities.write_text(json.dumps({"cvms": []}))
    local = {
        "runtime_dir": str(stack.state_dir),
        "name_prefix": stack.state.get("name_prefix", "umbra"),
        "security_cvm_port": stack.port("tunnel"),
        "security_cvm_release": release_doc,
        "collateral_file": str(stack.p("pki", "collateral.json")),
        "simulated_root": str(stack.p("pki", "root.der")),
        "console_url": stack.console_url,
        "simulated_pki": str(stack.p("pki")),
        "dev_cvm_release": dev_release_doc,
    }
    stack.p("local-cvms.json").write_text(json.dumps(local, indent=2))


def ssh_identity(stack: Stack) -> tuple[Path, str]:
    """The key the developer logs in with: their own (~/.ssh/id_*, only read), else a dedicated
    one made under the state directory. Returns (private key path, public line)."""
    for name in ("id_ed25519", "id_ecdsa", "id_rsa"):
        private = Path.home() / ".ssh" / name
        public = private.with_name(name + ".pub")
        if private.exists() and public.exists():
            return private, public.read_text().strip()
    private = stack.p("keys", "ssh", "id_ed25519")
    if not private.exists():
        private.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        done = subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "umbra-up", "-f", str(private)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if done.returncode != 0:
            raise UpError(f"ssh-keygen failed: {done.stderr.strip()}", "install openssh-client")
    return private, private.with_name("id_ed25519.pub").read_text().strip()


def save_client_opt_ins(stack: Stack, identity: Path) -> None:
    """This client trusts the simulated TEE of the Console `umbra up` started (that Console only)
    and logs in to its Dev CVMs with `identity`; ~/.ssh is never touched."""
    from umbra.cli.credentials import EmbeddedClient, save_embedded_client

    save_embedded_client(
        EmbeddedClient(
            console_url=stack.console_url,
            simulated_pki=str(stack.p("pki")),
            ssh_identity=str(identity),
        )
    )


def internet_targets() -> dict[str, str]:
    raw = os.environ.get("UMBRA_UP_INTERNET_TARGETS")
    if not raw:
        return dict(INTERNET_TARGETS)
    try:
        doc = json.loads(raw)
    except ValueError:
        raise UpError("UMBRA_UP_INTERNET_TARGETS is not JSON", "unset it or fix it") from None
    unknown = set(doc) - set(INTERNET_TARGETS) if isinstance(doc, dict) else {"(not an object)"}
    if unknown:
        raise UpError(f"UMBRA_UP_INTERNET_TARGETS: unknown keys {sorted(unknown)}")
    return INTERNET_TARGETS | {k: str(v) for k, v in doc.items()}


def internet_hosts() -> list[str]:
    targets = internet_targets()
    urls = (targets["pypi_index"], targets["pypi_files"], targets["git_url"])
    return sorted({str(httpx.URL(url).host) for url in urls})


def _resolve_now(hosts: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """The daily-work and --internet hosts resolved once, here, only to find a network's own
    mirror (`_allowed_upstreams`); a host that does not resolve is named in --internet's check."""
    from concurrent.futures import ThreadPoolExecutor

    def lookup(host: str) -> list[str] | None:
        try:
            infos = socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
        except OSError:
            return None
        return sorted({str(info[4][0]) for info in infos})

    # In parallel: every `up` pays this, and a name that does not resolve can take a while.
    with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
        results = dict(zip(hosts, pool.map(lookup, hosts), strict=True))
    answers = {host: found for host, found in results.items() if found is not None}
    return answers, [host for host, found in results.items() if found is None]


def _upstream_trust(stack: Stack) -> None:
    """The CAs the proxy trusts upstream: the system's (real hosts, or a mirror whose certificate
    chains to a CA the system trusts) and the stand-in origin's."""
    pem = stack.p("demo-origin", "ca.pem").read_bytes()
    for bundle in SYSTEM_CA_BUNDLES:
        if Path(bundle).is_file():
            pem += b"\n" + Path(bundle).read_bytes()
            break
    stack.p("security-cvm", "upstream-ca.pem").write_bytes(pem)


def _allowed_upstreams(stack: Stack) -> list[str]:
    """Loopback for the stand-in origin, and the non-public addresses the daily-work hosts
    resolved to (a network's own mirror): the proxy refuses non-global addresses unless told, and
    here it is told only for this embedded stack, with a warning naming host and address."""
    allowed = ["127.0.0.1/32"]
    for host, addresses in sorted(stack.state.get("mirrors", {}).items()):
        for address in addresses:
            ip = ipaddress.ip_address(address)
            stack.progress(
                f"warning: {host} resolves to {ip}, not a public address: allowed upstream for "
                "this embedded stack only"
            )
            allowed.append(f"{ip}/{ip.max_prefixlen}")
    return sorted(set(allowed))


def demo_profile(port: int) -> str:
    """The walkthrough's profile: the stand-in origin, GET and POST only, the demo token injected."""
    return f"""apiVersion: umbra/v1
kind: Profile
name: demo
description: umbra up's walkthrough origin (a local stand-in with its own CA).
egress:
  - id: demo-api
    allow: {{hosts: [{DEMO_HOSTS[0]}], ports: [{port}], methods: [GET, POST]}}
inject:
  - id: demo-token
    header: Authorization
    format: "Bearer {{secret}}"
    secret: team/{DEMO_SECRET_NAME}
    hosts: [{DEMO_HOSTS[0]}]
    ports: [{port}]
"""


# ---------------------------------------------------------------------- components


def _umbra() -> str:
    return str(Path(sys.executable).parent / "umbra")


def console_env(stack: Stack) -> dict[str, str]:
    p = stack.p
    return {
        "UMBRA_CONSOLE_DATABASE_URL": f"sqlite:///{p('console.db')}",
        "UMBRA_CONSOLE_OIDC_ISSUER": stack.issuer_url,
        "UMBRA_CONSOLE_OIDC_ALLOW_INSECURE_HTTP": "true",
        "UMBRA_CONSOLE_EMBEDDED_DEV": "true",
        "UMBRA_CONSOLE_BUNDLE_PUBLIC_KEYS": str(p("keys", "dev-release.pem.pub")),
        "UMBRA_CONSOLE_KEK_FILE": str(p("keys", "console-kek")),
        "UMBRA_CONSOLE_KEK_CURRENT": "k1",
        "UMBRA_CONSOLE_LOCAL_CVM_CONFIG": str(p("local-cvms.json")),
        "UMBRA_CONSOLE_RELEASE_POLICY": str(p("security-cvm", "release.json")),
        "UMBRA_CONSOLE_DEV_CVM_RELEASE_POLICY": str(p("dev-cvm-release.json")),
        "UMBRA_CONSOLE_RELEASE_COLLATERAL": str(p("pki", "collateral.json")),
        "UMBRA_CONSOLE_RELEASE_ALLOW_SIMULATED": "true",
        "UMBRA_CONSOLE_RELEASE_SIMULATED_ROOT": str(p("pki", "root.der")),
        "UMBRA_CONSOLE_LONG_POLL_DB_INTERVAL_SECONDS": "0.25",
    }


def start_issuer(stack: Stack) -> bool:
    if stack.pid("issuer") is not None:
        return False
    stack.spawn(
        "issuer",
        [
            sys.executable, "-m", "umbra.console.dev_issuer",
            "--state-dir", str(stack.p("issuer")), "--subject", SUBJECT,
            "--role", f"{TEAM}:admin", "--port", str(stack.port("issuer")),
        ],
    )  # fmt: skip
    stack.wait_http("issuer", stack.issuer_url + "/healthz")
    return True


def start_console(stack: Stack) -> bool:
    if stack.pid("console") is not None:
        return False
    stack.spawn(
        "console",
        [_umbra(), "console", "serve", "--port", str(stack.port("console")), "--migrate"],
        console_env(stack),
    )
    stack.wait_http("console", stack.console_url + "/healthz")
    return True


def start_origin(stack: Stack) -> bool:
    if stack.pid("origin") is not None:
        return False
    d = stack.p("demo-origin")
    stack.spawn(
        "origin",
        [
            sys.executable, "-m", "umbra.cli.demo_origin", "--cert", str(d / "origin.pem"),
            "--key", str(d / "origin-key.pem"), "--port", str(stack.port("origin")),
        ],
    )  # fmt: skip
    stack.wait_tcp("origin", stack.port("origin"), 20)
    return True


def llm_keys(stack: Stack) -> dict[str, str]:
    """The stand-in model API's two keys (random, 0600, made once): set as the team's and the
    developer's secrets, injected by the Security CVM; the sandbox holds placeholders only."""
    keys = {}
    for name, prefix in (("anthropic-api-key", "sk-ant-umbra-"), ("openai-api-key", "sk-umbra-")):
        path = stack.p("keys", name)
        if not path.exists():
            _write_secret(path, (prefix + secrets.token_urlsafe(24)).encode())
        keys[name] = path.read_text().strip()
    return keys


def start_llm_origin(stack: Stack) -> bool:
    if stack.pid("llm") is not None:
        return False
    d, keys = stack.p("demo-origin"), llm_keys(stack)
    stack.spawn(
        "llm",
        [
            sys.executable, "-m", "umbra.cli.llm_origin", "--cert", str(d / "origin.pem"),
            "--key", str(d / "origin-key.pem"), "--port", str(stack.port("llm")),
            # only the keys' digests: no key on a command line
            "--anthropic-key-sha256", hashlib.sha256(keys["anthropic-api-key"].encode()).hexdigest(),
            "--openai-key-sha256", hashlib.sha256(keys["openai-api-key"].encode()).hexdigest(),
        ],
    )  # fmt: skip
    stack.wait_tcp("llm", stack.port("llm"), 20)
    return True


def wait_tunnel(stack: Stack, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if stack.pid("proxy") is None:
            raise UpError(f"proxy exited while starting: {stack.log_tail('proxy')}")
        if _tcp_ok(stack.port("tunnel"), local_cvm.SECURITY_CVM_ADDR):
            return
        time.sleep(0.1)
    raise UpError(f"the tunnel endpoint did not listen within {timeout:.0f}s")


def _identities_hash(stack: Stack, argv: list[str]) -> str:
    """What the proxy loads only at start: the Dev CVMs it knows, the resolver map, the upstream
    CAs and its command line."""
    s = stack.p("security-cvm")
    raw = b"\0".join(
        [
            (s / name).read_bytes()
            for name in ("identities.json", "resolver.json", "upstream-ca.pem")
        ]
        + [json.dumps(argv).encode()]
    )
    return hashlib.sha256(raw).hexdigest()


def start_proxy(stack: Stack) -> bool:
    """The Security CVM; restarted when what it loads only at start changed."""
    s = stack.p("security-cvm")
    allow = [arg for cidr in _allowed_upstreams(stack) for arg in ("--test-allow-upstream", cidr)]
    argv = [
        _umbra(), "proxy", "serve",
        # One worker: the embedded stack serves one developer, and one process starts fastest.
        "--workers", "1",
        "--listen", f"127.0.0.1:{stack.port('proxy')}",
        # Reached from each local Dev CVM's forwarder namespace over its uplink veth only.
        "--tunnel-listen", f"{local_cvm.SECURITY_CVM_ADDR}:{stack.port('tunnel')}",
        "--identities", str(s / "identities.json"),
        "--traffic-log", str(s / "spool"),
        "--confdir", str(s / "mitm-ca"),
        "--console", stack.console_url,
        "--security-cvm-id", stack.state["security_cvm_id"],
        "--console-credential-file", str(s / "console-credential"),
        # Credentials only after attestation: at its first start the proxy enrolls with
        # this one-time token and keeps the sealed credential (root-only) from then on.
        "--enroll-token-file", str(s / "enrollment-token"),
        "--bundle-key", str(stack.p("keys", "dev-release.pem.pub")),
        "--state-dir", str(s / "state"),
        "--secrets-from-console",
        "--quote-source", "simulated",
        "--simulated-pki", str(stack.p("pki")),
        "--simulated-image", SIMULATED_IMAGE,
        # The system's CAs and the stand-in origin's (on loopback, embedded mode only).
        "--upstream-ca", str(s / "upstream-ca.pem"),
        *allow,
        # Real names through the system resolver, every address checked; the stand-in origin's
        # names are the one static exception.
        "--test-hosts", str(s / "resolver.json"),
    ]  # fmt: skip
    current = _identities_hash(stack, argv)
    if stack.pid("proxy") is not None:
        if stack.state.get("proxy_identities") == current:
            return False
        stack.stop("proxy")
    stack.spawn("proxy", argv)
    wait_tunnel(stack, 120)
    stack.state["proxy_identities"] = current
    stack.save()
    return True


# ---------------------------------------------------------------------- Console steps


def login(stack: Stack, env: dict[str, str]) -> None:
    done = subprocess.run(
        [_umbra(), "auth", "login", stack.console_url, "--issuer", stack.issuer_url,
         "--team", TEAM, "--json"],
        capture_output=True, text=True, env=env, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if done.returncode != 0:
        raise UpError(f"login failed: {(done.stdout + done.stderr).strip()[-400:]}")


def token(env: dict[str, str]) -> str:
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    doc = json.loads((Path(base) / "umbra" / "console.json").read_text())
    value: str = doc["token"]
    return value


def api(stack: Stack, bearer: str) -> httpx.Client:
    return httpx.Client(
        base_url=stack.console_url, headers={"Authorization": f"Bearer {bearer}"}, timeout=60
    )


def _expect(response: httpx.Response, *ok: int) -> Any:
    if response.status_code not in ok:
        raise UpError(
            f"Console {response.request.method} {response.request.url.path}: "
            f"{response.status_code} {response.text[:300]}"
        )
    return response.json() if response.content else None


def publish_bundle(stack: Stack, client: httpx.Client, policies: Path) -> int:
    from umbra.cli.up_agents import standin_profiles
    from umbra.policy.bundle import load_private_key, payload_document, sign_bundle
    from umbra.policy.loader import load_policy_dir

    work = stack.p("policy-build")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(policies, work)
    (work / "profiles" / "zz-umbra-up-demo.yaml").write_text(demo_profile(stack.port("origin")))
    for name, text in standin_profiles(LLM_HOST, stack.port("llm")).items():
        (work / "profiles" / f"zz-umbra-up-{name}.yaml").write_text(text)
    shutil.rmtree(work / "tests", ignore_errors=True)
    loaded = load_policy_dir(work)
    compiled = [p.compiled for p in loaded.profiles.values()]
    digest = hashlib.sha256(
        json.dumps(sorted(p.model_dump_json() for p in compiled)).encode()
    ).hexdigest()
    stack.state["bundle_profiles"] = sorted(loaded.profiles)
    if stack.state.get("bundle_digest") == digest:
        return int(stack.state["bundle_serial"])
    serial = max(int(time.time()), int(stack.state.get("bundle_serial", 0)) + 1)
    key = load_private_key(stack.p("keys", "dev-release.pem"))
    raw = sign_bundle(payload_document(compiled, serial, "umbra up: policies/"), [key])
    _expect(client.post(f"/api/v1/teams/{TEAM}/bundles", content=raw), 200, 201)
    stack.state.update(bundle_digest=digest, bundle_serial=serial)
    stack.save()
    return serial


def ensure_security_cvm(stack: Stack, client: httpx.Client) -> str:
    """Register the Security CVM and hand its process a one-time enrollment token (never a
    credential: the proxy enrolls at start, proxy/enroll.py)."""
    from umbra.attest.enroll_client import spent_marker

    known = stack.state.get("security_cvm_id")
    credential = stack.p("security-cvm", "console-credential")
    token_file = stack.p("security-cvm", "enrollment-token")
    if known:
        info = client.get(f"/api/v1/cvms/{known}")
        if info.status_code == 200 and info.json().get("state") not in ("destroyed", "failed"):
            if credential.exists() or token_file.exists():
                return str(known)  # enrolled, or about to enroll with its unspent token
            _mint_token(client, str(known), token_file)  # the credential was lost
            return str(known)
    created = _expect(
        client.post(
            f"/api/v1/teams/{TEAM}/cvms",
            json={"name": f"{SECURITY_CVM_NAME}-{int(time.time())}", "kind": "security"},
        ),
        201,
    )
    stack.stop("proxy")  # it serves the old Security CVM's identity
    for stale in (credential, spent_marker(credential)):
        stale.unlink(missing_ok=True)
    _mint_token(client, str(created["id"]), token_file)
    stack.state["security_cvm_id"] = created["id"]
    stack.save()
    return str(created["id"])


def _mint_token(client: httpx.Client, cvm_id: str, token_file: Path) -> None:
    minted = _expect(client.post(f"/api/v1/cvms/{cvm_id}/enrollment-token"), 201)
    _write_secret(token_file, str(minted["token"]).encode())


def ensure_demo_secret(client: httpx.Client, value: str) -> None:
    ensure_secret(client, f"team/{DEMO_SECRET_NAME}", value, DEMO_HOSTS[0])


def ensure_secret(client: httpx.Client, ref: str, value: str, host: str) -> None:
    """Set a team (`team/NAME`) or the developer's personal (`personal/NAME`) secret."""
    scope, name = ref.split("/", 1)
    path = "secrets" if scope == "team" else "personal-secrets"
    _expect(
        client.put(f"/api/v1/teams/{TEAM}/{path}/{name}", json={"value": value, "hosts": [host]}),
        200,
        201,
    )


def ensure_llm_secrets(stack: Stack, client: httpx.Client) -> None:
    from umbra.cli.up_agents import ANTHROPIC_KEY_REF, OPENAI_KEY_REF

    keys = llm_keys(stack)
    ensure_secret(client, ANTHROPIC_KEY_REF, keys["anthropic-api-key"], LLM_HOST)
    ensure_secret(client, OPENAI_KEY_REF, keys["openai-api-key"], LLM_HOST)


def ensure_dev_cvm(stack: Stack, client: httpx.Client, scvm_id: str, ssh_keys: list[str]) -> str:
    """Launch the Dev CVM as `umbra cvm launch` does, or bring the known one back up."""
    known = stack.state.get("dev_cvm_id")
    if known:
        info = client.get(f"/api/v1/cvms/{known}")
        plan = local_cvm.load_plan(stack.p("cvms"), str(known))
        # A CVM launched without the SSH ingress (an older state directory) is launched anew.
        usable = plan is not None and plan.ingress_config.exists()
        if info.status_code == 200 and info.json().get("state") == "running" and plan and usable:
            local_cvm.ensure_network(plan)
            local_cvm.ensure_running(plan)
            if _canonical(info.json().get("ssh_keys", [])) != _canonical(ssh_keys):
                # The developer's key changed (e.g. they made ~/.ssh/id_ed25519 since): bind
                # the new one; the provider restarts the ingress with it.
                patch = client.patch(f"/api/v1/cvms/{known}", json={"ssh_keys": ssh_keys})
                _wait_settled(client, str(_expect(patch, 200)["id"]), "updating")
            return str(known)
        if info.status_code == 200 and info.json().get("state") != "destroyed":
            client.delete(f"/api/v1/cvms/{known}")
    # The team's defaults: the Console attaches them to the Dev CVM at launch (any provider).
    profiles = [p for p in DEFAULT_PROFILES if p in stack.state.get("bundle_profiles", [])]
    _expect(client.put(f"/api/v1/teams/{TEAM}/default-profiles", json={"profiles": profiles}), 200)
    created = _expect(
        client.post(
            f"/api/v1/teams/{TEAM}/cvms",
            json={
                "name": f"{DEV_CVM_NAME}-{int(time.time())}",
                "security_cvm_id": scvm_id,
                "ssh_keys": ssh_keys,
            },
        ),
        201,
    )
    _wait_settled(client, str(created["id"]), "launching")
    stack.state["dev_cvm_id"] = created["id"]
    stack.save()
    return str(created["id"])


def _canonical(keys: list[str]) -> set[str]:
    from umbra.attest.measurement import canonical_ssh_key

    return {canonical_ssh_key(k) for k in keys}


def _wait_settled(client: httpx.Client, cvm_id: str, transitional: str) -> None:
    """The Console's provisioning job builds (or updates) the local Dev CVM in the background."""
    info = _expect(client.get(f"/api/v1/cvms/{cvm_id}"), 200)
    end = time.monotonic() + 120
    while info.get("state") == transitional and time.monotonic() < end:
        time.sleep(0.1)
        info = _expect(client.get(f"/api/v1/cvms/{cvm_id}"), 200)
    if info.get("state") != "running":
        raise UpError(f"the Dev CVM did not start: {info.get('state_reason') or info}")


def ensure_sandbox_image(stack: Stack) -> tuple[Path, ...]:
    """The sandbox image, built once per machine (minutes, with progress) and then cached."""
    from umbra.sandbox import image

    try:
        return image.ensure_image(progress=stack.progress)
    except image.ImageError as exc:
        raise UpError(str(exc), "see the line above; then run `umbra up` again") from None


def wait_sandbox_ca(stack: Stack, cvm_id: str, timeout: float = 60) -> None:
    """The sandbox trusts the Security CVM's interception CA once its forwarder has fetched it
    inside an attested session and the sandbox's init has put it in the system store (as in the
    cloud: sandbox_ca.py, umbra-sandbox-init)."""
    plan = local_cvm.load_plan(stack.p("cvms"), cvm_id)
    if plan is None:
        return
    installed = plan.rootfs / local_cvm.CA_INSTALLED.lstrip("/")
    fetched = plan.dir / "sandbox-ca" / CA_NAME
    started = time.monotonic()
    end = started + timeout
    restarted = False
    while time.monotonic() < end:
        if installed.exists():
            return
        if not restarted and not fetched.exists() and time.monotonic() - started > 1:
            # The forwarder started before the Security CVM and is backing off (up to 30 s):
            # a fresh one fetches at once, inside its own attested session as always.
            local_cvm.stop(plan, "forwarder")
            local_cvm.ensure_running(plan)
            restarted = True
        time.sleep(0.2)
    raise UpError(
        f"the sandbox of {cvm_id} did not install the Security CVM's CA within {timeout:.0f} s",
        f"see {plan.dir / 'forwarder.log'}",
    )


# ---------------------------------------------------------------------- down and status


def down(stack: Stack) -> list[str]:
    stopped = [name for name in reversed(COMPONENTS) if stack.stop(name)]
    for plan in local_cvm.all_plans(stack.p("cvms")):
        local_cvm.shut_down(plan)
        stopped.append(f"dev-cvm {plan.cvm_id}")
    return stopped


def status(stack: Stack) -> dict[str, Any]:
    out: dict[str, Any] = {"state_dir": str(stack.state_dir), "components": {}}
    probes = {
        "issuer": lambda: _http_ok(stack.issuer_url + "/healthz"),
        "console": lambda: _http_ok(stack.console_url + "/healthz"),
        "origin": lambda: _tcp_ok(stack.port("origin")),
        "llm": lambda: _tcp_ok(stack.port("llm")),
        "proxy": lambda: _tcp_ok(stack.port("tunnel"), local_cvm.SECURITY_CVM_ADDR),
    }
    for name in COMPONENTS:
        pid = stack.pid(name)
        out["components"][name] = {
            "pid": pid,
            "running": pid is not None,
            "healthy": pid is not None and probes[name](),
        }
    out["console_url"] = stack.console_url
    out["dev_cvms"] = []
    for plan in local_cvm.all_plans(stack.p("cvms")):
        info = local_cvm.status(plan)
        info["healthy"] = bool(
            info["sandbox_pid"]
            and info["forwarder_pid"]
            and (info["ssh_ingress"] is None or info["ingress_pid"])
        )
        out["dev_cvms"].append(info)
    return out


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _tcp_ok(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), 1):
            return True
    except OSError:
        return False
