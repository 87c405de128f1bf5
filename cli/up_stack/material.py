"""One-time material under the state directory: development keys, the simulated TEE's PKI and
golden values, the stand-in origins' CA, the config files the components read, and the
developer's SSH identity. Made once, reused after."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

from umbra.cli.up_stack.errors import UpError
from umbra.cli.up_stack.names import (
    DEMO_HOSTS,
    ORIGIN_NAMES,
    SIMULATED_IMAGE,
    VENDOR_ADDR,
    VENDOR_HOSTS,
    Port,
)
from umbra.cli.up_stack.supervise import Stack
from umbra.cli.up_stack.upstream import find_mirrors, upstream_trust
from umbra.contracts.files import write_atomic
from umbra.sandbox import local_cvm


def _pem_cert(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    data: bytes = cert.public_bytes(serialization.Encoding.PEM)
    return data


def _names(cert: Path) -> set[str]:
    """The DNS names and IP addresses a stand-in certificate covers (an older state dir's may
    lack one)."""
    from cryptography import x509

    try:
        parsed = x509.load_pem_x509_certificate(cert.read_bytes())
        sans = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (OSError, ValueError, x509.ExtensionNotFound):
        return set()
    ips = {str(ip) for ip in sans.value.get_values_for_type(x509.IPAddress)}
    return set(sans.value.get_values_for_type(x509.DNSName)) | ips


def origin_names(stack: Stack) -> frozenset[str]:
    """The names the stand-in origins answer to (the agents' own hosts only when opted in)."""
    return ORIGIN_NAMES | (frozenset(VENDOR_HOSTS) if vendor_standins(stack) else frozenset())


def vendor_standins(stack: Stack) -> bool:
    return bool(stack.state.get("vendor_standins"))


def _demo_ca(
    directory: Path, names: frozenset[str] = ORIGIN_NAMES, ips: frozenset[str] = frozenset()
) -> None:
    """A CA of its own for the stand-in origin, and the origin's certificate (for `names`,
    127.0.0.1 and `ips`)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if (directory / "origin.pem").exists() and _names(directory / "origin.pem") >= names | ips:
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
    sans: list[x509.GeneralName] = [x509.DNSName(h) for h in sorted(names)]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in sorted({"127.0.0.1", *ips})]
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
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_secret(directory / "origin-key.pem", pem)
    (directory / "origin.pem").write_bytes(_pem_cert(cert))


def tls_identity(directory: Path, names: frozenset[str], ips: frozenset[str] = frozenset()) -> None:
    """A CA of its own and a server certificate for `names` and `ips` in `directory` (`ca.pem`,
    `origin.pem`, `origin-key.pem` 0600), made once (again if a name is missing)."""
    _demo_ca(directory, names, ips)


def write_secret(path: Path, data: bytes) -> None:
    """A key or token: 0600 whatever the umask, written whole or not at all."""
    write_atomic(path, data, 0o600)


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
        write_secret(kek, f"k1={base64.b64encode(os.urandom(32)).decode()}\n".encode())
    pki = SimulatedPki.load_or_create(stack.p("pki"))
    # Collateral is dated: refreshed on every `umbra up` so it never expires under a long run.
    stack.p("pki", "collateral.json").write_text(pki.collateral(int(time.time()) - 3600).json_text)
    stack.p("pki", "root.der").write_bytes(pki.root_der)
    release = SimulatedTdx(pki, image=SIMULATED_IMAGE).release_manifest()
    release_doc = release.model_dump(mode="json", exclude_none=True)
    stack.p("security-cvm").mkdir(exist_ok=True, mode=0o700)
    stack.p("security-cvm", "release.json").write_text(json.dumps(release_doc, indent=2))
    _demo_ca(stack.p("demo-origin"), origin_names(stack))
    # The proxy resolves real names with the system resolver; the stand-in origin's names are
    # the one static exception (`--test-hosts`).
    resolver: dict[str, list[str]] = {host: ["127.0.0.1"] for host in sorted(ORIGIN_NAMES)}
    if vendor_standins(stack):
        resolver |= {host: [VENDOR_ADDR] for host in VENDOR_HOSTS}
    stack.p("security-cvm", "resolver.json").write_text(json.dumps(resolver))
    find_mirrors(stack, skip=set(resolver))
    upstream_trust(stack)
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
        "security_cvm_port": stack.port(Port.TUNNEL),
        "security_cvm_release": release_doc,
        "collateral_file": str(stack.p("pki", "collateral.json")),
        "simulated_root": str(stack.p("pki", "root.der")),
        "console_url": stack.console_url,
        "simulated_pki": str(stack.p("pki")),
        "dev_cvm_release": dev_release_doc,
    }
    stack.p("local-cvms.json").write_text(json.dumps(local, indent=2))


def llm_keys(stack: Stack) -> dict[str, str]:
    """The stand-in model API's two keys (random, 0600, made once): set as the team's and the
    developer's secrets, injected by the Security CVM; the sandbox holds placeholders only."""
    keys = {}
    for name, prefix in (("anthropic-api-key", "sk-ant-umbra-"), ("openai-api-key", "sk-umbra-")):
        path = stack.p("keys", name)
        if not path.exists():
            write_secret(path, (prefix + secrets.token_urlsafe(24)).encode())
        keys[name] = path.read_text().strip()
    return keys


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


def claude_oauth_token(stack: Stack) -> str:
    """With the vendor stand-ins: the subscription token the stand-in accepts (random, 0600, made
    once), for `umbra connect claude --token-file` (the shape `claude setup-token` prints)."""
    path = stack.p("keys", "claude-oauth-token")
    if not path.exists():
        write_secret(path, ("sk-ant-oat01-umbra-" + secrets.token_urlsafe(32)).encode())
    return path.read_text().strip()
