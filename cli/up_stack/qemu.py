"""`umbra up --runtime qemu`: the team's Security CVM and the developer's Dev CVM are the built
`qemu` OS image booted under QEMU by the Console's `qemu` provider (console/providers_qemu.py),
in a cloud's shape.

- **Preflight**: qemu-system-x86_64 and OVMF's firmware, named with their Debian packages.
- **Acceleration**: KVM when a paused QEMU with `-accel kvm` survives its vCPU set-up (a nested
  KVM that opens `/dev/kvm` but aborts on the first MSR write does not count), TCG otherwise.
- **The Security release**: a Security CVM definition for this stack (the proxy image the disk
  carries, the Console by address, the stack's bundle key, quotes from the VM's TDX module, the
  stack's PCCS by address, and as test options the stand-in origins by address with their CA),
  measured: its app-compose.json is the Security VM's launch data, its release what the Console
  verifies the proxy's enrollment against and what the Dev release pins.
- **The Dev release**: a Dev CVM definition for this stack (simulated TEE, the Security release
  above, the Console's URL), measured like `umbra image measure` does: its
  app-compose.json is the launch data's compose, and its release (compose hash, `umbra.cvm-id`,
  the boot events) is what the Console verifies the VM's enrollment quotes against.
- **The provider's config** (`qemu-cvms.json`): shape, disk, that app-compose, the VMs' runtime
  directory `qemu/`, the stack's simulated PKI (the VMs' TDX modules sign with it).
- **The VMs** as processes (found, shown, stopped): vms.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from enum import StrEnum
from pathlib import Path
from typing import Any

from umbra.cli.up_stack.errors import UpError
from umbra.cli.up_stack.names import (
    COMPONENTS,
    ORIGIN_NAMES,
    QEMU_ONLY,
    RUNC_ONLY,
    SIMULATED_IMAGE,
    Component,
    Port,
)
from umbra.cli.up_stack.supervise import Stack
from umbra.cli.up_stack.vms import QEMU, RUNTIME_DIR, stop_vms
from umbra.components.ports import SECURITY_TUNNEL_PORT

CONFIG = "qemu-cvms.json"
ACCELS = ("auto", "kvm", "tcg")
# The Console's name the Dev workload enrolls at (measured in the release), over TLS by its own
# CA (tls_front.py, `console-tls/ca.pem` in launch data), dialled at CONSOLE_IP (no DNS in a VM).
CONSOLE_NAME = "console.umbra.internal"
CONSOLE_IN_VM = f"https://{CONSOLE_NAME}"
# Inside QEMU's 168.0.0.0/6 (emulated.qemu.NETWORK): the addresses launch data names for the
# Console (its TLS front) and the Security CVM's tunnel endpoint, and where the Security CVM
# reaches the stand-in origins and the PCCS, each relayed to a loopback port of this host.
CONSOLE_IP, SECURITY_IP = "168.1.0.10", "168.1.0.20"
ORIGIN_IP, PCCS_IP = "168.1.0.30", "168.1.0.40"
# The Security VM's proxy reaches the Console by address (no DNS in a VM; its TLS front's
# certificate names this address too).
CONSOLE_BY_ADDRESS = f"https://{CONSOLE_IP}"
# Only the local sandbox needs these (the qemu image carries its own workload).
SANDBOX_ONLY_TOOLS = frozenset({"runc", "npm"})


class Runtime(StrEnum):
    """What runs the developer's Dev CVM: a runc sandbox on this machine, or a VM under QEMU."""

    runc = "runc"
    qemu = "qemu"


def runtime(stack: Stack) -> Runtime:
    return Runtime(stack.state.get("runtime", Runtime.runc))


def components(stack: Stack) -> tuple[Component, ...]:
    """The processes this runtime runs, in start order: under qemu the TLS front and PCCS, and
    no proxy (the Security CVM is a VM)."""
    skip = RUNC_ONLY if runtime(stack) is Runtime.qemu else QEMU_ONLY
    return tuple(c for c in COMPONENTS if c not in skip)


def tunnel_host(stack: Stack) -> str:
    """Where the Security CVM's tunnel endpoint listens: the local Dev CVMs' uplink address, or
    (a VM's guestfwd relays to loopback) 127.0.0.1 under `--runtime qemu`."""
    from umbra.sandbox import local_cvm

    return "127.0.0.1" if runtime(stack) is Runtime.qemu else local_cvm.SECURITY_CVM_ADDR


def preflight() -> None:
    """QEMU and its firmware, before anything starts."""
    from umbra.emulated.qemu import OVMF

    if shutil.which(QEMU) is None:
        raise UpError(
            f"--runtime qemu needs {QEMU}, which is not installed",
            "apt-get install qemu-system-x86 (or ./scripts/system-deps as root)",
        )
    if not OVMF.is_file():
        raise UpError(
            f"--runtime qemu needs OVMF's UEFI firmware {OVMF}, which is missing",
            "apt-get install ovmf (or ./scripts/system-deps as root)",
        )


def choose_accel(probe_seconds: float = 2.0) -> str:
    """`kvm` if a paused KVM guest survives its vCPU set-up, else `tcg`."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    argv = [
        QEMU, "-accel", "kvm", "-cpu", "host", "-machine", "q35", "-m", "64", "-nodefaults",
        "-display", "none", "-monitor", "none", "-serial", "none", "-S",
    ]  # fmt: skip
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    except OSError:
        return "tcg"
    try:
        proc.wait(probe_seconds)
        return "tcg"  # it exited (here: "failed to set MSR 0x10a", an abort)
    except subprocess.TimeoutExpired:
        return "kvm"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def security_definition_doc(stack: Stack, proxy_digest: str) -> dict[str, Any]:
    """This stack's Security CVM release (images/definitions/security-cvm.example.yaml's shape)."""
    return {
        "apiVersion": "umbra/v1",
        "kind": "ImageDefinition",
        "role": "security-cvm",
        "tee": "simulated",
        "base": {"simulated_image": SIMULATED_IMAGE},
        "compose": {
            "release": "security-cvm-up-qemu",
            "images": {"proxy": f"umbra/proxy@{proxy_digest}"},
            "console_url": CONSOLE_BY_ADDRESS,
            "console_ca": True,
            "bundle_keys": [stack.p("keys", "dev-release.pem.pub").read_text()],
            "tunnel_port": SECURITY_TUNNEL_PORT,
            # The VM's TDX module signs its quotes (the stack's simulated PKI).
            "simulated": {"image": SIMULATED_IMAGE, "source": "emulated"},
            # Its tunnel endpoint sends the collateral along (the Dev VM reaches no PCCS).
            "pccs_urls": [f"http://{PCCS_IP}:{stack.port(Port.PCCS)}"],
            # The stand-in origins: by address on the emulated network, trusted by their own CA.
            "test_options": {
                "allow_upstream": [f"{ORIGIN_IP}/32"],
                "resolver": {host: [ORIGIN_IP] for host in sorted(ORIGIN_NAMES)},
                "upstream_ca": stack.p("demo-origin", "ca.pem").read_text(),
            },
        },
    }


def write_security_release(stack: Stack, proxy_digest: str) -> None:
    """The measured Security release: `qemu/security-app-compose.json` (the Security VM's launch
    data) and `security-cvm/release.json` (the Console's `release_policy`, pinned by the Dev
    release), replacing the host-simulator release `prepare_material` wrote."""
    from umbra.images.definition import parse_definition
    from umbra.images.measure import measure

    m = measure(parse_definition(security_definition_doc(stack, proxy_digest)))
    d = stack.p(RUNTIME_DIR)
    d.mkdir(exist_ok=True, mode=0o700)
    (d / "security-app-compose.json").write_bytes(m.app_compose)
    release = m.release.model_dump(mode="json", exclude_none=True)
    stack.p("security-cvm", "release.json").write_text(json.dumps(release, indent=2))


def dev_definition_doc(stack: Stack, security_release: dict[str, Any]) -> dict[str, Any]:
    """This stack's Dev CVM release (images/definitions/dev-cvm.example.yaml's shape)."""
    from umbra.sandbox import image

    return {
        "apiVersion": "umbra/v1",
        "kind": "ImageDefinition",
        "role": "dev-cvm",
        "tee": "simulated",
        "base": {"simulated_image": "umbra-dev-cvm"},
        "host": {
            "release": "dev-cvm-up-qemu",
            "sandbox_image": {"recipe_key": image.recipe_key(), "files_key": image.files_key()},
            # The cloud's tunnel port (the Dev host firewall admits no other), relayed to
            # the stack's tunnel endpoint on loopback (`_network`).
            "security_cvm": {"host": SECURITY_IP, "port": SECURITY_TUNNEL_PORT},
            "security_cvm_release": security_release,
            "console_url": CONSOLE_IN_VM,
            "console_ca": True,
            # The forwarder quotes through the host's TDX module.
            "quote_source": "emulated",
            "allow_simulated": True,
            # The stack's simulated PKI signs the local Security CVM's quotes: the Dev release
            # names its root, which the dev host hands the forwarder.
            "simulated_root": stack.p("pki", "root.pem").read_text(),
            "tunnels": [],
        },
    }


def write_dev_release(stack: Stack) -> None:
    """The measured Dev release: `qemu/app-compose.json` (launch data) and
    `dev-cvm-release.json` (what the Console verifies enrollment quotes against)."""
    from umbra.images.definition import parse_definition
    from umbra.images.measure import measure

    security = json.loads(stack.p("security-cvm", "release.json").read_text())
    m = measure(parse_definition(dev_definition_doc(stack, security)))
    d = stack.p(RUNTIME_DIR)
    d.mkdir(exist_ok=True, mode=0o700)
    (d / "app-compose.json").write_bytes(m.app_compose)
    release = m.release.model_dump(mode="json", exclude_none=True)
    stack.p("dev-cvm-release.json").write_text(json.dumps(release, indent=2))


def provider_settings(stack: Stack, disk: Path, accel: str) -> dict[str, Any]:
    """The `qemu` provider's config (console/providers_qemu.QemuCvmSettings), by field name."""
    return {
        "shape": stack.state.get("shape", "gcp"),
        "disk": str(disk),
        "app_compose": str(stack.p(RUNTIME_DIR, "app-compose.json")),
        "runtime_dir": str(stack.p(RUNTIME_DIR)),
        "accel": accel,
        # The Dev workload (runc, the sandbox, the forwarder, sshd) wants more than the default.
        "memory_mb": 1536,
        "console_url": CONSOLE_IN_VM,
        "console_ca": str(stack.p("console-tls", "ca.pem")),
        "simulated_pki": str(stack.p("pki")),
        "security_app_compose": str(stack.p(RUNTIME_DIR, "security-app-compose.json")),
        "security_tunnel_port": SECURITY_TUNNEL_PORT,
        # The Dev VM's forward to SECURITY_IP reaches the Security VM's tunnel here.
        "security_tunnel_host_port": stack.port(Port.TUNNEL),
        **_network(stack),
    }


def _network(stack: Stack) -> dict[str, Any]:
    """The emulated network and the Dev ingress: the Console's and the Security CVM's addresses
    (the only ones a Dev VM's host firewall admits), the stand-in origins' and the PCCS's (what
    the Security VM's proxy reaches), their forwards to loopback; the Dev release for `umbra
    ssh`."""
    tunnel = stack.port(Port.TUNNEL)
    same_port = [(ORIGIN_IP, Port.ORIGIN), (ORIGIN_IP, Port.LLM), (PCCS_IP, Port.PCCS)]
    return {
        "console_ips": [CONSOLE_IP],
        "security_cvm_ips": [SECURITY_IP],
        "forwards": [
            {"address": CONSOLE_IP, "port": 443, "host_port": stack.port(Port.CONSOLE_TLS)},
            {"address": SECURITY_IP, "port": SECURITY_TUNNEL_PORT, "host_port": tunnel},
            *(
                {"address": ip, "port": stack.port(p), "host_port": stack.port(p)}
                for ip, p in same_port
            ),
        ],
        "release_manifest": str(stack.p("dev-cvm-release.json")),
    }


def write_provider_config(stack: Stack, disk: Path, accel: str) -> Path:
    """Validated by the provider's own model before the Console reads it."""
    from pydantic import ValidationError

    from umbra.console.providers_qemu import QemuCvmSettings
    from umbra.contracts.validation import first_problem

    doc = provider_settings(stack, disk, accel)
    try:
        QemuCvmSettings.model_validate(doc)
    except ValidationError as exc:
        raise UpError(f"the qemu provider's config: {first_problem(exc)}") from None
    text = json.dumps(doc, indent=2)
    digest = hashlib.sha256(text.encode()).hexdigest()
    if stack.state.get("qemu_config") != digest and stack.pid(Component.CONSOLE) is not None:
        # The Console reads it at start only: a new disk (a changed tree) or acceleration
        # means a new Console, and its VM goes with the old one.
        stack.progress("the qemu provider's config changed: restarting the Console and its VM")
        stop_vms(stack)
        stack.stop(Component.CONSOLE)
    path = stack.p(CONFIG)
    path.write_text(text)
    stack.state["qemu_config"] = digest
    return path
