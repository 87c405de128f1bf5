"""What the embedded Security CVM may reach and trust upstream: the --internet targets, a
network's own mirrors (found by resolving the daily-work hosts once), and the CA bundle."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from pathlib import Path

import httpx

from umbra.cli.up_stack.errors import UpError
from umbra.cli.up_stack.supervise import Stack

# `--internet`: what `pip download` and `git ls-remote` use. UMBRA_UP_INTERNET_TARGETS (JSON,
# the same keys) points them elsewhere: a mirror, or the stand-in origin in the wiring test.
INTERNET_TARGETS = {
    "pypi_index": "https://pypi.org/simple",
    "pypi_files": "https://files.pythonhosted.org",
    "package": "requests",
    "git_url": "https://github.com/git/git",
}
SYSTEM_CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
# The hosts of the default profiles (devcvm.DEFAULT_PROFILES): resolved once at `up` only to find
# a network's own mirror (a non-public address the proxy would refuse), which this embedded stack
# then allows, with a warning. The proxy itself resolves every name live with the system resolver.
DAILY_HOSTS = (
    "pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "deb.debian.org",
    "security.debian.org", "github.com", "gitlab.com",
)  # fmt: skip


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


def resolve_now(hosts: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """The daily-work and --internet hosts resolved once, here, only to find a network's own
    mirror (`allowed_upstreams`); a host that does not resolve is named in --internet's check."""
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


def find_mirrors(stack: Stack, skip: set[str]) -> None:
    """Record (in the state) the daily-work hosts that resolve to a non-public address, and the
    --internet hosts that do not resolve at all."""
    hosts = sorted(set(DAILY_HOSTS) | set(internet_hosts()))
    found, unresolved = resolve_now([h for h in hosts if h not in skip])
    stack.state["mirrors"] = {
        host: [a for a in addresses if not ipaddress.ip_address(a).is_global]
        for host, addresses in found.items()
        if any(not ipaddress.ip_address(a).is_global for a in addresses)
    }
    stack.state["internet_unresolved"] = unresolved


def upstream_trust(stack: Stack) -> None:
    """The CAs the proxy trusts upstream: the system's (real hosts, or a mirror whose certificate
    chains to a CA the system trusts) and the stand-in origin's."""
    pem = stack.p("demo-origin", "ca.pem").read_bytes()
    for bundle in SYSTEM_CA_BUNDLES:
        if Path(bundle).is_file():
            pem += b"\n" + Path(bundle).read_bytes()
            break
    stack.p("security-cvm", "upstream-ca.pem").write_bytes(pem)


def allowed_upstreams(stack: Stack) -> list[str]:
    """Loopback for the stand-in origin, and the non-public addresses the daily-work hosts
    resolved to (a network's own mirror): the proxy refuses non-global addresses unless told, and
    here it is told only for this embedded stack, with a warning naming host and address."""
    from umbra.cli.up_stack.names import VENDOR_ADDR

    allowed = ["127.0.0.1/32"]
    if stack.state.get("vendor_standins"):
        allowed.append(f"{VENDOR_ADDR}/32")
    for host, addresses in sorted(stack.state.get("mirrors", {}).items()):
        for address in addresses:
            ip = ipaddress.ip_address(address)
            stack.progress(
                f"warning: {host} resolves to {ip}, not a public address: allowed upstream for "
                "this embedded stack only"
            )
            allowed.append(f"{ip}/{ip.max_prefixlen}")
    return sorted(set(allowed))
