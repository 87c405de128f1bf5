"""The measured Dev CVM host definition, `dev-cvm.json`: what a cloud Dev CVM runs, as data.

The Dev CVM runs the same sandbox as `umbra up` (the runc runtime, the mmdebstrap image, the
forwarder with its resolver and transparent ports, sandbox/local_cvm.py's namespaces), so its
release is not a compose file but this document. It names:
- `sandbox_image`: the image's two cache keys (sandbox/image.py); the OS image ships that tree;
- `network`: the runc topology's addresses (index 1 of local_cvm's scheme) and `forwarder`, the
  forwarder's whole configuration, with the Security CVM's golden values, the attested CA's and
  the sandbox environment's files (local_cvm.sandbox_env_config, as `umbra up`'s);
- `ssh_ingress`: where the attested SSH ingress lets a developer in.

It is canonical JSON (sorted keys, no whitespace, ASCII), wrapped by the release's
app-compose.json as `{dev_cvm_host, manifest_version: 2, name, runner: "umbra-dev-host"}`: its
SHA-256 is the compose hash extended into RTMR3, so every byte here is measured. Loading refuses,
with the field and the reason, anything that would loosen the topology (another address, a
credential in launch data, a sandbox CA outside the read-only directory, no resolver).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import Field, ValidationError, model_validator

from umbra.contracts.model import Strict
from umbra.contracts.validation import lines
from umbra.sandbox import image
from umbra.sandbox.forwarder_config import ForwarderConfig
from umbra.sandbox.local_cvm import (
    SANDBOX_DNS_PORT,
    SANDBOX_PROXY_PORT,
    SANDBOX_SESSIONS,
    SANDBOX_TRANSPARENT_HTTP,
    SANDBOX_TRANSPARENT_HTTPS,
    UID_BASE,
    UID_COUNT,
    LocalCvmPlan,
    sandbox_env_base,
    sandbox_env_config,
)
from umbra.sandbox.models import (
    ATTESTED_SSH_PORT,
    DevCvmInputs,
    Port,
    SandboxImageKeys,
    SimulatedRootPem,
)
from umbra.sandbox.render import CA_NAME, Rendered, canonical_json

DEFINITION_NAME: Final = "dev-cvm.json"
RUNNER: Final = "umbra-dev-host"
LAUNCH_DIR: Final = "/run/umbra/launch"
# The forwarder's launch-bound files (the launch agent writes them: cvm-id, enrollment token,
# event log, Console and Security CVM addresses).
FORWARDER_LAUNCH_DIR: Final = f"{LAUNCH_DIR}/forwarder"
# The tunnel credential: host tmpfs (the /var overlay), so a reboot re-enrolls by a fresh quote.
FORWARDER_STATE_DIR: Final = "/var/lib/umbra/forwarder"
# The sandbox's directory (its overlay's upper layer, nested Docker's data, the attested CA, the
# rendered /etc/umbra): on the data disk, so the developer's work survives a stop.
DEV_HOST_ROOT: Final = "/var/lib/umbra/data/dev-host"
SANDBOX_CA_FILE: Final = f"{DEV_HOST_ROOT}/sandbox-ca/{CA_NAME}"
# The sandbox's environment (the CVM's values, then the attached profiles' `sandbox_env`), kept
# current by the forwarder; the same file and refresh as `umbra up` (sandbox_env_sync.py).
SANDBOX_ENV_FILE: Final = f"{DEV_HOST_ROOT}/sandbox-etc/sandbox.env"
# The one sandbox of a cloud Dev CVM takes local_cvm's subnet index 1: 10.231.1.0/30 (sandbox ↔
# forwarder) and 10.232.1.0/30 (forwarder ↔ host, masqueraded by the host firewall).
NETWORK_INDEX: Final = 1
NETNS_PREFIX: Final = "umbra"


class DevHostError(Exception):
    """A Dev CVM host definition is refused; the message names the document, field and reason."""


class HostNetwork(Strict):
    """The runc topology's addresses; each must be what local_cvm computes for `index`."""

    index: Annotated[int, Field(ge=1, le=249)]
    sandbox: str
    forwarder: str
    uplink: str
    host: str


class SshIngress(Strict):
    """The attested SSH ingress (a host process, docs/specs/session.md) and who it logs in as."""

    port: Port
    user: Literal["dev"]
    uid: Literal[1000]
    home: Literal["/home/dev"]
    sessions_dir: Literal["/run/umbra-sessions"]


class DevCvmHost(Strict):
    apiVersion: Literal["umbra/v1"]
    kind: Literal["DevCvmHost"]
    release: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]{0,62}$")]
    sandbox_image: SandboxImageKeys
    network: HostNetwork
    forwarder: ForwarderConfig
    ssh_ingress: SshIngress
    # The release's simulated root (DevCvmInputs.simulated_root): written by the dev host where
    # `forwarder.simulated_root` points, before the forwarder starts.
    simulated_root: SimulatedRootPem | None = None

    @model_validator(mode="after")
    def _topology(self) -> DevCvmHost:
        want = network(self.network.index)
        for field in ("sandbox", "forwarder", "uplink", "host"):
            got, expected = getattr(self.network, field), getattr(want, field)
            if got != expected:
                raise ValueError(
                    f"network.{field}: {got} is not the runc topology's {expected} "
                    f"for index {self.network.index}"
                )
        fwd = self.forwarder
        if fwd.listen.host != self.network.forwarder:
            raise ValueError(
                "forwarder.listen.host must be network.forwarder (the only address the "
                "sandbox reaches)"
            )
        if fwd.listen.transparent is None or fwd.listen.dns_port is None:
            raise ValueError(
                "forwarder.listen needs transparent and dns_port: the sandbox's resolver "
                "answers every name with the forwarder, whose 443/80 take it from there"
            )
        if fwd.enrollment is None or fwd.credential_file is None:
            raise ValueError(
                "forwarder.enrollment is required: the tunnel credential comes only from an "
                "attested enrollment, never from launch data"
            )
        if str(fwd.credential_file).startswith(LAUNCH_DIR + "/"):
            raise ValueError(
                "forwarder.credential_file must not be under /run/umbra/launch (launch data)"
            )
        ca = fwd.sandbox_ca
        if ca is None or (ca.file.parent.name, ca.file.name) != ("sandbox-ca", CA_NAME):
            # The dev host binds <its root>/sandbox-ca read-only into the sandbox and checks the
            # root at start (a definition's is SANDBOX_CA_FILE).
            raise ValueError(
                f"forwarder.sandbox_ca.file must be <root>/sandbox-ca/{CA_NAME} (the directory "
                f"bound read-only into the sandbox; {SANDBOX_CA_FILE} on a CVM)"
            )
        env = fwd.sandbox_env
        if env is None or (env.file.parent.name, env.file.name) != ("sandbox-etc", "sandbox.env"):
            # Sessions get the attached profiles' `sandbox_env` only through this file, which
            # the dev host binds read-only at /etc/umbra (a definition's is SANDBOX_ENV_FILE).
            raise ValueError(
                "forwarder.sandbox_env.file must be <root>/sandbox-etc/sandbox.env (the directory "
                f"bound read-only into the sandbox; {SANDBOX_ENV_FILE} on a CVM)"
            )
        if self.simulated_root is not None and fwd.simulated_root is None:
            raise ValueError("simulated_root needs forwarder.allow_simulated (and its path)")
        base = sandbox_env_base(plan_for("cvm_0", self.network.index, Path(DEV_HOST_ROOT)))
        if env.base != base:
            # The sandbox's start renders this CVM's values itself: two bases would flap.
            raise ValueError(
                "forwarder.sandbox_env.base must be the runc topology's own values (the proxy, "
                f"NO_PROXY, the CA variables) for index {self.network.index}"
            )
        return self

    @property
    def tcp_ports(self) -> list[int]:
        """Every sandbox-side TCP listener of the forwarder (its namespace admits only these)."""
        listen = self.forwarder.listen
        ports = [listen.proxy_port, *(t.listen_port for t in listen.tunnels)]
        if listen.transparent is not None:
            ports += [listen.transparent.https_port, listen.transparent.http_port]
        if listen.dns_port is not None:
            ports.append(listen.dns_port)
        return ports


def plan_for(cvm_id: str, index: int, directory: Path) -> LocalCvmPlan:
    """The runc topology's plan for the Dev CVM's one sandbox (local_cvm's addressing)."""
    return LocalCvmPlan(cvm_id, index, NETNS_PREFIX, str(directory), UID_BASE + index * UID_COUNT)


def network(index: int) -> HostNetwork:
    plan = plan_for("cvm_0", index, Path(DEV_HOST_ROOT))
    return HostNetwork(
        index=index,
        sandbox=plan.sandbox_addr,
        forwarder=plan.forwarder_addr,
        uplink=plan.uplink_addr,
        host=plan.host_addr,
    )


def forwarder_config(inputs: DevCvmInputs, index: int = NETWORK_INDEX) -> dict[str, Any]:
    """The forwarder's configuration on a cloud Dev CVM: host paths (it runs as a host process
    in its own network namespace), the launch agent's files, the topology's listeners."""
    doc: dict[str, Any] = {
        "apiVersion": "umbra/v1",
        "kind": "ForwarderConfig",
        "listen": {
            "host": network(index).forwarder,
            "proxy_port": SANDBOX_PROXY_PORT,
            "tunnels": [t.model_dump(mode="json") for t in inputs.tunnels],
            "transparent": {
                "https_port": SANDBOX_TRANSPARENT_HTTPS,
                "http_port": SANDBOX_TRANSPARENT_HTTP,
            },
            "dns_port": SANDBOX_DNS_PORT,
        },
        "security_cvm": inputs.security_cvm.model_dump(mode="json"),
        "security_cvm_release": inputs.security_cvm_release.model_dump(
            mode="json", exclude_none=True
        ),
        # No PCCS is reachable from a cloud Dev CVM: by default the Security CVM relays its own.
        "collateral": {"pccs_urls": list(inputs.pccs_urls)}
        if inputs.pccs_urls
        else {"relayed": True},
        "cvm_id_file": f"{FORWARDER_LAUNCH_DIR}/cvm-id",
        "credential_file": f"{FORWARDER_STATE_DIR}/tunnel-credential",
        "sandbox_ca": {"file": SANDBOX_CA_FILE},
        "sandbox_env": sandbox_env_config(plan_for("cvm_0", index, Path(DEV_HOST_ROOT))),
        # The Dev CVM resolves nothing: the launch agent's Security CVM address(es), by file.
        "security_cvm_ips_file": f"{FORWARDER_LAUNCH_DIR}/security-cvm-ips",
        "enrollment": {
            "console_url": inputs.console_url,
            "token_file": f"{FORWARDER_LAUNCH_DIR}/enrollment-token",
            "quote_source": inputs.quote_source,
            "event_log": f"{FORWARDER_LAUNCH_DIR}/event-log.json",
            "console_ips_file": f"{FORWARDER_LAUNCH_DIR}/console-ips",
        },
    }
    if inputs.console_ca:
        doc["enrollment"]["console_ca"] = f"{FORWARDER_LAUNCH_DIR}/console-ca.pem"
    if inputs.allow_simulated:
        doc["allow_simulated"] = True
        doc["simulated_root"] = f"{FORWARDER_LAUNCH_DIR}/simulated-root.der"
    return doc


def host_document(inputs: DevCvmInputs, index: int = NETWORK_INDEX) -> dict[str, Any]:
    return {
        "apiVersion": "umbra/v1",
        "kind": "DevCvmHost",
        "release": inputs.release,
        "sandbox_image": inputs.sandbox_image.model_dump(mode="json"),
        "network": network(index).model_dump(mode="json"),
        "forwarder": forwarder_config(inputs, index),
        "ssh_ingress": {
            "port": ATTESTED_SSH_PORT,
            "user": image.USER,
            "uid": image.USER_ID,
            "home": f"/home/{image.USER}",
            "sessions_dir": SANDBOX_SESSIONS,
        },
        **({"simulated_root": inputs.simulated_root} if inputs.simulated_root else {}),
    }


def render_dev_host(inputs: DevCvmInputs) -> Rendered:
    """`dev-cvm.json`, canonical, checked by the same loader the launch agent uses."""
    text = canonical_json(host_document(inputs))
    load_dev_host(text)
    return Rendered(DEFINITION_NAME, text)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"duplicate key {dupes[0]!r}")
    return dict(pairs)


def load_dev_host(text: str, source: str = DEFINITION_NAME) -> DevCvmHost:
    """Parse and check a host definition's exact bytes; every refusal names the field."""
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except ValueError as exc:
        raise DevHostError(f"{source}: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise DevHostError(f"{source}: top level must be an object")
    if canonical_json(doc) != text:
        # Measured bytes must be the canonical form, or two texts could mean one release.
        raise DevHostError(f"{source}: not canonical JSON (sorted keys, no whitespace, ASCII)")
    try:
        return DevCvmHost.model_validate(doc)
    except ValidationError as exc:
        raise DevHostError(
            "\n".join(f"{source}: {ln}" for ln in lines(exc, "(top level)"))
        ) from None
