"""An emulated-cloud VM: QEMU booting the built OS image's disk under OVMF, as GCP or Azure would.

- **Firmware**: OVMF; with a variable store holding the release certificate (images.secure_boot
  .ovmf_vars) its Secure Boot build (SMM, secure pflash), as both clouds boot the image.
- **SMBIOS**: the cloud's own system information (GCP: `Google` / `Google Compute Engine`;
  Azure: `Microsoft Corporation` / `Virtual Machine`), which the image's launch agent reads
  (`--cloud smbios`, images.cloud_id) to take that cloud's path.
- **Network**: QEMU user networking on 168.0.0.0/6, the smallest network that holds both the
  metadata address 169.254.169.254 and Azure's wire server 168.63.129.16 (slirp forwards only
  addresses inside its network), with `restrict=on`: the guest reaches nothing but the two
  forwards, each to a stand-in on 127.0.0.1 (emulated.metadata) through emulated.relay, started
  per connection, and the `forwards` a Dev workload needs (the Console's and its Security CVM's
  addresses, inside the network, to their loopback ports); the SSH ingress is published on a
  loopback port (`hostfwd`). No packet of the guest's leaves the host.
- **Disks**: the boot disk read through a throw-away overlay (`snapshot=on`: as a cloud image,
  never changed by a boot), and a raw data disk file that persists across stop and start.
- **TEE**: with `tdx_module`, a virtio-serial port `org.umbra.tdx-module` connected to the host's
  simulated TDX module (emulated.tdx_module): the guest's `--tee emulated` extends RTMR3 and
  quotes there.
- **Stop**: ACPI power button (`system_powerdown` on QMP), as `gcloud compute instances stop`
  and an Azure deallocation shut the guest down; a guest that does not stop in time is killed.
- **Reboot**: a TD does not survive a reset (the hardware tears it down; GCP and Azure build a
  new TD on the same disks). QEMU runs with `-no-reboot`, so a reset, the guest's own (`reboot`,
  a triple fault) or the host's (`system_reset`, as `gcloud compute instances reset` or `az vm
  restart`), ends the process; `watch` reports why (QMP's `SHUTDOWN` reason, read on a second
  QMP socket of its own, `qev.sock`) and the provider boots the next one: a new TD, whose
  module connection starts from fresh registers.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from umbra.attest.tdx_port import TDX_PORT_NAME
from umbra.emulated import relay
from umbra.emulated.metadata import METADATA_ADDRESS, WIRE_SERVER_ADDRESS, Shape

OVMF = Path("/usr/share/ovmf/OVMF.fd")
# 168.0.0.0/6 = 168.0.0.0 - 171.255.255.255: both forwarded addresses are inside it.
NETWORK = "168.0.0.0/6"
GATEWAY, DNS, DHCP_START = "168.0.0.2", "168.0.0.3", "168.0.0.15"
SMBIOS = {
    Shape.gcp: ("Google", "Google Compute Engine"),
    Shape.azure: ("Microsoft Corporation", "Virtual Machine"),
}


class VmError(Exception):
    pass


@dataclass(frozen=True)
class Firmware:
    """`vars` None: OVMF.fd, Secure Boot off. Otherwise `code` is OVMF's Secure Boot build and
    `vars` this VM's own copy of a variable store (the firmware writes it)."""

    code: Path = OVMF
    vars: Path | None = None

    def argv(self) -> list[str]:
        if self.vars is None:
            return ["-machine", "q35", "-bios", str(self.code)]
        return [
            "-machine", "q35,smm=on", "-global", "driver=cfi.pflash01,property=secure,value=on",
            "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={self.code}",
            "-drive", f"if=pflash,format=raw,unit=1,file={self.vars}",
        ]  # fmt: skip


@dataclass(frozen=True)
class Forward:
    """A guest connection to `address:port` (inside NETWORK) relayed to 127.0.0.1:`host_port`:
    how the Dev CVM reaches the Console and its Security CVM by address (launch data's
    `console_ips`, `security_cvm_ips`), and nothing else."""

    address: str
    port: int
    host_port: int


@dataclass(frozen=True)
class Published:
    """A guest TCP port published on 127.0.0.1:`host_port` (`hostfwd`): a Dev CVM's attested SSH
    ingress (`umbra ssh` dials it), a Security CVM's tunnel endpoint (the Dev CVMs' forwards and
    a host verifier dial it)."""

    host_port: int
    guest_port: int


@dataclass(frozen=True)
class VmConfig:
    shape: Shape
    disk: Path  # the OS image's disk.raw (not written: snapshot=on)
    data_disk: Path  # raw, persists across stop and start
    serial: Path  # this boot's serial console (QEMU's `file:` truncates it)
    qmp: Path  # QMP's unix socket (commands: the power button, a reset)
    metadata_port: int
    wire_port: int
    firmware: Firmware = Firmware()
    # The host's simulated TDX module (emulated.tdx_module) this VM's port connects to; None:
    # no port (the guest then cannot measure or quote with `--tee emulated`).
    tdx_module: Path | None = None
    # The emulated network: exactly these guest destinations (guestfwd), and these guest ports
    # published on loopback (hostfwd: a Dev CVM's attested SSH ingress, a Security CVM's tunnel).
    forwards: tuple[Forward, ...] = ()
    published: tuple[Published, ...] = ()
    memory_mb: int = 1024
    accel: str = "tcg"
    python: str = sys.executable

    @property
    def events(self) -> Path:
        """A second QMP socket, only read: its events say why QEMU ended (`QemuVm.watch`)."""
        return self.qmp.with_name(EVENTS_SOCKET)


# Beside the command socket; named as short as the provider's `qmp.sock`: a unix socket's path
# has at most 107 bytes.
EVENTS_SOCKET = "qev.sock"
# QMP's SHUTDOWN reasons under -no-reboot that are a reset, not a power-off: the cloud builds a
# new TD on the same disks.
RESETS = frozenset({"guest-reset", "host-qmp-system-reset"})


def guestfwd(address: str, port: int, python: str, guest_port: int = 80) -> str:
    # QEMU's option syntax: a comma inside a value is written twice (none here).
    return (
        f"guestfwd=tcp:{address}:{guest_port}-cmd:{python} -I -S {relay.__file__} 127.0.0.1 {port}"
    )


RESERVED = {GATEWAY, DNS, METADATA_ADDRESS, WIRE_SERVER_ADDRESS}


def check_forward(forward: Forward) -> None:
    """slirp relays only addresses inside its network; the stand-ins' and slirp's own are taken."""
    try:
        address = ipaddress.IPv4Address(forward.address)
    except ValueError:
        raise VmError(f"forward {forward.address!r}: not an IPv4 address") from None
    if address not in ipaddress.IPv4Network(NETWORK) or forward.address in RESERVED:
        raise VmError(
            f"forward {forward.address}: must be inside {NETWORK} and not one of "
            f"{', '.join(sorted(RESERVED))} (QEMU user networking relays only its own network)"
        )
    if not (0 < forward.port < 65536 and 0 < forward.host_port < 65536):
        raise VmError(f"forward {forward.address}:{forward.port}: ports must be 1-65535")


def netdev(config: VmConfig) -> str:
    parts = [
        "user", "id=n0", f"net={NETWORK}", f"host={GATEWAY}", f"dns={DNS}",
        f"dhcpstart={DHCP_START}", "restrict=on",
        guestfwd(METADATA_ADDRESS, config.metadata_port, config.python),
    ]  # fmt: skip
    if config.shape is Shape.azure:
        parts.append(guestfwd(WIRE_SERVER_ADDRESS, config.wire_port, config.python))
    for forward in config.forwards:
        check_forward(forward)
        parts.append(guestfwd(forward.address, forward.host_port, config.python, forward.port))
    for p in config.published:
        parts.append(f"hostfwd=tcp:127.0.0.1:{p.host_port}-:{p.guest_port}")
    return ",".join(parts)


def tdx_port(socket_path: Path) -> list[str]:
    """The guest's virtio-serial port `org.umbra.tdx-module`, connected to the host's TDX module
    on `socket_path` (QEMU dials it at start, and exits if it is not there: fail closed)."""
    return [
        "-device", "virtio-serial-pci,id=vs0",
        "-chardev", f"socket,id=tdx,path={socket_path}",
        "-device", f"virtserialport,bus=vs0.0,chardev=tdx,name={TDX_PORT_NAME}",
    ]  # fmt: skip


def qemu_argv(config: VmConfig) -> list[str]:
    manufacturer, product = SMBIOS[config.shape]
    module = [] if config.tdx_module is None else tdx_port(config.tdx_module)
    return [
        "qemu-system-x86_64", *config.firmware.argv(), "-accel", config.accel,
        # TCG: -cpu max, for RDRAND, which seeds the kernel's CRNG at once (see tests/images/
        # test_qemu_boot.py: without it getrandom() blocked for minutes). KVM: the host's CPU
        # (unproven: under the development machine's nested KVM QEMU 7.2 aborted setting MSR
        # 0x10a with `max` and `host` alike).
        "-cpu", "host" if config.accel == "kvm" else "max",
        "-m", str(config.memory_mb), "-smp", "1",
        "-smbios", f"type=1,manufacturer={manufacturer},product={product}",
        "-drive", f"file={config.disk},format=raw,if=virtio,snapshot=on",
        "-drive", f"file={config.data_disk},format=raw,if=virtio",
        "-netdev", netdev(config), "-device", "virtio-net-pci,netdev=n0", *module,
        "-display", "none", "-monitor", "none", "-serial", f"file:{config.serial}",
        "-qmp", f"unix:{config.events},server=on,wait=off",
        "-qmp", f"unix:{config.qmp},server=on,wait=off", "-no-reboot",
    ]  # fmt: skip


def create_data_disk(path: Path, size_gb: int) -> None:
    """A blank sparse raw disk (the launch agent formats it on the first boot); kept if it
    exists: it is the VM's persistent disk, grown (never shrunk) to `size_gb`."""
    if path.exists():
        if path.stat().st_size < size_gb * 1024**3:
            os.truncate(path, size_gb * 1024**3)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.truncate(size_gb * 1024**3)


class QemuVm:
    """One boot of a VM: `start`, then `stop` (ACPI) or `kill`. A new boot is a new QemuVm."""

    def __init__(self, config: VmConfig) -> None:
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> QemuVm:
        self.config.qmp.unlink(missing_ok=True)
        self.config.events.unlink(missing_ok=True)
        # QEMU's own messages go to a file beside the serial log: a pipe nobody drains would
        # block a long-running VM.
        try:
            with self.qemu_log.open("wb") as log:
                self.process = subprocess.Popen(
                    qemu_argv(self.config), stdout=subprocess.DEVNULL, stderr=log
                )
        except OSError as exc:
            raise VmError(f"qemu-system-x86_64: {exc.strerror}") from None
        return self

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def serial_text(self) -> str:
        path = self.config.serial
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, timeout: float = 300) -> bool:
        """ACPI power button, then wait for QEMU to exit; True if the guest shut itself down
        (killed otherwise)."""
        if not self.running():
            return True
        with contextlib.suppress(OSError):
            self._qmp(["system_powerdown"])
        assert self.process is not None
        try:
            self.process.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            self.kill()
            return False

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def reset(self) -> None:
        """The host's reset button (QMP `system_reset`): under -no-reboot QEMU ends, `watch`
        says `host-qmp-system-reset`."""
        self._qmp(["system_reset"])

    def watch(self) -> str | None:
        """Block until QEMU exits; the reason of its QMP `SHUTDOWN` event (`guest-shutdown`,
        `guest-reset`, `host-qmp-system-reset`, ...), or None when it ended without one (killed,
        crashed) or the events socket never answered."""
        assert self.process is not None
        reason = None
        with contextlib.suppress(OSError, ValueError):
            reason = self._shutdown_reason()
        self.process.wait()
        return reason

    def _shutdown_reason(self) -> str | None:
        path = self.config.events
        while not path.exists():
            if not self.running():
                return None
            time.sleep(0.2)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(path))
            f = sock.makefile("rwb")
            f.readline()  # the greeting
            f.write(b'{"execute": "qmp_capabilities"}\n')
            f.flush()
            reason = None
            for line in f:  # until QEMU closes it, exiting
                message = json.loads(line)
                if message.get("event") == "SHUTDOWN":
                    reason = str(message.get("data", {}).get("reason"))
            return reason

    @property
    def qemu_log(self) -> Path:
        return self.config.serial.with_suffix(".qemu.log")

    def stderr(self) -> str:
        return self.qemu_log.read_text(errors="replace") if self.qemu_log.exists() else ""

    def _qmp(self, commands: Sequence[str]) -> None:
        deadline = time.monotonic() + 10
        while not self.config.qmp.exists():
            if time.monotonic() > deadline:
                raise OSError(f"{self.config.qmp}: QMP socket never appeared")
            time.sleep(0.2)
        qmp(self.config.qmp, *commands)


def qmp(path: Path, *commands: str, timeout: float = 10) -> None:
    """Each QMP command in turn on the socket at `path` (events in between skipped); OSError
    if the socket does not answer or QEMU refuses one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        f = sock.makefile("rwb")
        f.readline()  # the greeting
        for command in ("qmp_capabilities", *commands):
            f.write(json.dumps({"execute": command}).encode() + b"\n")
            f.flush()
            while True:  # skip events until this command's answer
                try:
                    answer = json.loads(f.readline() or b"{}")
                except ValueError:
                    raise OSError(f"QMP {command}: not JSON") from None
                if "return" in answer or "error" in answer or not answer:
                    break
            if "error" in answer:
                raise OSError(f"QMP {command}: {answer['error']}")
