"""Launch-bound configuration: what a CVM's measured boot reads from instance metadata (GCP) or
user data (Azure IMDS). The host can rewrite these bytes, so the guest never trusts them as given:
its launch agent hashes app-compose.json, the CVM id and the SSH keys and extends them into RTMR3
(`compose-hash`, `umbra.cvm-id`, `umbra.ssh-authorized-keys`) before starting anything, and the CLI/Console
refuse a quote whose replayed events differ from the release manifest and instance binding.
The digests here are informational copies for operators, computed the same way.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from umbra.attest.measurement import COMPOSE_HASH_EVENT, SSH_KEYS_EVENT, ssh_keys_digest
from umbra.components.host_firewall import HostFirewall, render_host_ruleset
from umbra.contracts.canonical import canonical_text as canonical_json
from umbra.contracts.enrollment import META_ENROLLMENT_TOKEN as _ENROLLMENT_KEY

# Re-exported: the stacks and their tests name them from here.
from umbra.contracts.session import CONSOLE_LAUNCH_EVENT as CONSOLE_LAUNCH_EVENT
from umbra.contracts.session import CVM_ID_EVENT as CVM_ID_EVENT
from umbra.contracts.session import HOST_FIREWALL_EVENT as HOST_FIREWALL_EVENT

# GCP metadata and Azure custom-data keys the image's launch agent reads.
META_APP_COMPOSE = "umbra-app-compose"
META_COMPOSE_HASH = "umbra-compose-hash"
META_CVM_ID = "umbra-cvm-id"
META_SSH_KEYS = "umbra-ssh-authorized-keys"
META_MANIFEST = "umbra-measurement-manifest"
META_ROLE = "umbra-role"
META_TEAM = "umbra-team"
META_EVENTS = "umbra-rtmr3-events"
# Dev CVMs: the host nftables ruleset (components.host_firewall) the launch agent loads with
# `nft -f` before starting containers, and the Security CVM address(es) it writes to /etc/hosts
# as SECURITY_CVM_HOST. Security CVMs: the resolvers (space-separated) for its resolv.conf.
META_HOST_FIREWALL = "umbra-host-firewall"
META_SECURITY_CVM_IPS = "umbra-security-cvm-ips"
META_DNS_RESOLVERS = "umbra-dns-resolvers"
# Both roles: where the Console is and the CA its TLS chains to (PEM; absent: public CA). A Dev
# CVM's forwarder enrolls there once; it has no DNS, so its launch data also names the Console's
# address(es) (space-separated IPv4), which its host firewall admits from the uplink on 443 only
# and the launch agent writes to forwarder/console-ips for the forwarder to dial.
META_CONSOLE_URL = "umbra-console-url"
META_CONSOLE_CA = "umbra-console-ca"
META_CONSOLE_IPS = "umbra-console-ips"
# Console: the CA its database's TLS certificate chains to (verify-full against exactly this).
META_DATABASE_CA = "umbra-database-ca"
# Where the launch agent writes it; the stack's database URL names it as its sslrootcert.
DATABASE_CA_PATH = "/run/umbra/launch/database-ca.pem"
# Console: its database (a postgresql:// URL without a password, verify-full), its TLS
# certificate chain (PEM), and references to the two secrets it needs (components.secret_refs:
# a Secret Manager version or a Key Vault secret URI, read at boot with the VM's identity). The
# values never ride in launch data. All four are measured (umbra.console-launch).
META_DATABASE_URL = "umbra-database-url"
META_DATABASE_PASSWORD_REF = "umbra-database-password-ref"  # noqa: S105 (a key name)
META_CONSOLE_TLS_CERT = "umbra-console-tls-cert"
META_CONSOLE_TLS_KEY_REF = "umbra-console-tls-key-ref"
# Console, optional (required by the stack for replicas > 1): a reference to its WEB_SESSION_KEY,
# written to console/web-session-key; measured with the four above when present.
META_WEB_SESSION_KEY_REF = "umbra-console-web-session-key-ref"
# Security CVM replicas: the internal load balancer's address, added as a local route.
META_LB_IP = "umbra-lb-ip"
# The one-time enrollment token (contracts/enrollment.py): the only credential launch data
# carries; the launch agent gives it to the enrolling service only (its launch directory, 0400).
# Not measured (it is spent at first boot and differs per launch).
META_ENROLLMENT_TOKEN = _ENROLLMENT_KEY
# The cloud VM name the launch data was rendered for: the launch agent refuses it on a VM the
# metadata service names otherwise (launch data copied to another CVM). Not measured.
META_INSTANCE_NAME = "umbra-instance-name"
# Every key launch data may carry: the launch agent refuses any other.
META_KEYS = frozenset(
    {
        META_APP_COMPOSE,
        META_COMPOSE_HASH,
        META_CVM_ID,
        META_SSH_KEYS,
        META_MANIFEST,
        META_ROLE,
        META_TEAM,
        META_EVENTS,
        META_HOST_FIREWALL,
        META_SECURITY_CVM_IPS,
        META_DNS_RESOLVERS,
        META_CONSOLE_URL,
        META_CONSOLE_CA,
        META_CONSOLE_IPS,
        META_DATABASE_CA,
        META_DATABASE_URL,
        META_DATABASE_PASSWORD_REF,
        META_CONSOLE_TLS_CERT,
        META_CONSOLE_TLS_KEY_REF,
        META_WEB_SESSION_KEY_REF,
        META_LB_IP,
        META_ENROLLMENT_TOKEN,
        META_INSTANCE_NAME,
    }
)
# Azure limits user data to 64 KiB after base64.
AZURE_USER_DATA_MAX = 65536

PLACEHOLDER_MARK = "# UMBRA PLACEHOLDER COMPOSE: not a release, do not attest against it"


def placeholder_app_compose(role: str) -> str:
    """An app-compose.json (the measured document, see umbra.images.measure) around a compose
    file that starts nothing useful, for trying the program before a release exists. Its hash
    matches no release manifest, so no verifier accepts the CVM."""
    compose = (
        f"{PLACEHOLDER_MARK}\n"
        f"name: umbra-{role}-placeholder\n"
        "services:\n"
        "  placeholder:\n"
        "    image: busybox@sha256:0000000000000000000000000000000000000000000000000000000000000000\n"
        '    command: ["sh", "-c", "echo placeholder compose; sleep infinity"]\n'
        "    network_mode: none\n"
    )
    return canonical_json(
        {
            "docker_compose_file": compose,
            "manifest_version": 2,
            "name": f"umbra-{role}-placeholder",
            "runner": "docker-compose",
        }
    )


def console_launch_digest(
    database_url: str,
    database_ca: str | None,
    tls_cert: str,
    password_ref: str,
    tls_key_ref: str,
    web_session_key_ref: str | None = None,
) -> bytes:
    """The umbra.console-launch payload (one definition: the agent and verifiers both call it).
    The web session key's reference is a member only when there is one."""
    doc = {
        "database_ca": database_ca or "",
        "database_password_ref": password_ref,
        "database_url": database_url,
        "tls_cert": tls_cert,
        "tls_key_ref": tls_key_ref,
    }
    if web_session_key_ref:
        doc["web_session_key_ref"] = web_session_key_ref
    return hashlib.sha256(canonical_json(doc).encode()).digest()


def measured_document(doc: object) -> str | None:
    """The measured document an app-compose.json wraps: a Security CVM's compose file
    (`docker_compose_file`) or a Dev CVM's host definition (`dev_cvm_host`); None if neither."""
    if not isinstance(doc, dict):
        return None
    for key in ("docker_compose_file", "dev_cvm_host"):
        if isinstance(doc.get(key), str):
            return str(doc[key])
    return None


@dataclass(frozen=True)
class LaunchData:
    """`app_compose` is the release's app-compose.json text: canonical JSON wrapping the rendered
    docker-compose file. Its SHA-256 is the compose hash the release manifest pins."""

    role: str
    team: str
    cvm_id: str
    app_compose: str
    measurement_manifest: str | None = None
    ssh_authorized_keys: Sequence[str] = field(default_factory=tuple)
    security_cvm_ips: Sequence[str] = field(default_factory=tuple)
    dns_resolvers: Sequence[str] = field(default_factory=tuple)
    lb_ip: str | None = None
    console_url: str | None = None
    console_ca: str | None = None
    console_ips: Sequence[str] = field(default_factory=tuple)
    database_ca: str | None = None
    # Console only (META_DATABASE_URL …): see console_launch_sha256.
    database_url: str | None = None
    database_password_ref: str | None = None
    console_tls_cert: str | None = None
    console_tls_key_ref: str | None = None
    web_session_key_ref: str | None = None
    enrollment_token: str | None = field(default=None, repr=False)
    # The cloud the VM runs on ("gcp" | "azure"): the host ruleset admits root's ready report to
    # that cloud's endpoint. Not a launch key: the launch agent knows its cloud (`--cloud`).
    cloud: str | None = None
    # The cloud VM name it was rendered for (META_INSTANCE_NAME); None: not checked.
    instance_name: str | None = None

    @property
    def host_firewall(self) -> str | None:
        if not self.security_cvm_ips:
            return None
        return render_host_ruleset(
            HostFirewall(
                security_cvm_ips=tuple(self.security_cvm_ips),
                console_ips=tuple(self.console_ips),
                cloud=self.cloud,
            )
        )

    @property
    def console_launch_sha256(self) -> str | None:
        """The Console's launch-bound configuration (umbra.console-launch): SHA-256 of the
        canonical JSON of its database URL and CA, TLS certificate and the secret references
        (what it connects to, what it presents, and where its secrets are read from)."""
        if self.database_url is None:
            return None
        return console_launch_digest(
            self.database_url,
            self.database_ca,
            self.console_tls_cert or "",
            self.database_password_ref or "",
            self.console_tls_key_ref or "",
            self.web_session_key_ref,
        ).hex()

    @property
    def compose_sha256(self) -> str:
        return hashlib.sha256(self.app_compose.encode()).hexdigest()

    @property
    def ssh_keys_sha256(self) -> str | None:
        if not self.ssh_authorized_keys:
            return None
        return ssh_keys_digest(list(self.ssh_authorized_keys)).hex()

    @property
    def is_placeholder(self) -> bool:
        try:
            doc = json.loads(self.app_compose)
        except ValueError:
            return False
        compose = doc.get("docker_compose_file") if isinstance(doc, dict) else None
        return isinstance(compose, str) and compose.startswith(PLACEHOLDER_MARK)

    def expected_events(self) -> dict[str, str]:
        """RTMR3 runtime events, name -> payload hex, in the order the launch agent extends
        them: the release-bound compose hash, then the launch-bound CVM id, SSH keys and the
        host firewall ruleset (SHA-256 of its bytes)."""
        events = {
            COMPOSE_HASH_EVENT: self.compose_sha256,
            CVM_ID_EVENT: self.cvm_id.encode().hex(),
        }
        if self.ssh_keys_sha256 is not None:
            events[SSH_KEYS_EVENT] = self.ssh_keys_sha256
        ruleset = self.host_firewall
        if ruleset is not None:
            events[HOST_FIREWALL_EVENT] = hashlib.sha256(ruleset.encode()).hexdigest()
        console = self.console_launch_sha256
        if console is not None:
            events[CONSOLE_LAUNCH_EVENT] = console
        return events

    def as_metadata(self) -> dict[str, str]:
        meta = {
            META_ROLE: self.role,
            META_TEAM: self.team,
            META_CVM_ID: self.cvm_id,
            META_APP_COMPOSE: self.app_compose,
            META_COMPOSE_HASH: self.compose_sha256,
            META_EVENTS: json.dumps(self.expected_events()),
        }
        if self.ssh_authorized_keys:
            meta[META_SSH_KEYS] = "\n".join(self.ssh_authorized_keys) + "\n"
        if self.measurement_manifest:
            meta[META_MANIFEST] = self.measurement_manifest
        ruleset = self.host_firewall
        if ruleset is not None:
            meta[META_HOST_FIREWALL] = ruleset
            meta[META_SECURITY_CVM_IPS] = " ".join(self.security_cvm_ips)
        if self.console_ips:
            meta[META_CONSOLE_IPS] = " ".join(self.console_ips)
        if self.dns_resolvers:
            meta[META_DNS_RESOLVERS] = " ".join(self.dns_resolvers)
        if self.lb_ip:
            meta[META_LB_IP] = self.lb_ip
        for key, value in (
            (META_CONSOLE_URL, self.console_url),
            (META_CONSOLE_CA, self.console_ca),
            (META_DATABASE_CA, self.database_ca),
            (META_DATABASE_URL, self.database_url),
            (META_DATABASE_PASSWORD_REF, self.database_password_ref),
            (META_CONSOLE_TLS_CERT, self.console_tls_cert),
            (META_CONSOLE_TLS_KEY_REF, self.console_tls_key_ref),
            (META_WEB_SESSION_KEY_REF, self.web_session_key_ref),
            (META_ENROLLMENT_TOKEN, self.enrollment_token),
            (META_INSTANCE_NAME, self.instance_name),
        ):
            if value:
                meta[key] = value
        return meta

    def gcp_metadata(self) -> dict[str, str]:
        # Keys GCP's own agents would honour are shut so only the measured keys log in.
        return self.as_metadata() | {
            "block-project-ssh-keys": "TRUE",
            "enable-oslogin": "FALSE",
            "serial-port-enable": "FALSE",
        }

    def azure_user_data(self) -> str:
        """The VM's `userData` (IMDS serves it to the guest; custom data it does not)."""
        blob = canonical_json({"umbra": self.as_metadata()})
        encoded = base64.b64encode(blob.encode()).decode()
        if len(encoded) > AZURE_USER_DATA_MAX:
            raise ValueError(
                f"{self.role} launch data is {len(encoded)} bytes after base64; "
                f"Azure user data holds at most {AZURE_USER_DATA_MAX}"
            )
        return encoded
