"""`umbra up --runtime qemu`'s VMs as processes: QEMU runs in the Console's process group and
carries its `UMBRA_UP_STATE` marker; `vms()` finds them in /proc by that marker and their data
disk's path (`qemu/<cvm id>/data.raw`), so `umbra status` shows them and `umbra down` stops them:
the ACPI power button over QMP (as a cloud's stop presses it), then SIGKILL after a grace period.
`reset` presses the reset button (`--check`'s reboot).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from umbra.cli.up_stack.supervise import Stack

QEMU = "qemu-system-x86_64"
RUNTIME_DIR = "qemu"
# A stopping guest gets this long after the power button before it is killed, as GCP's stop
# gives it (under TCG a systemd shutdown takes 5-30 s here, a Dev CVM's up to a minute when
# loaded; systemd's own bound on a unit's stop is 90 s).
STOP_GRACE = 90.0


@dataclass(frozen=True)
class Vm:
    """One QEMU process of this stack."""

    pid: int
    cvm_id: str
    qmp: Path | None


def _cmdline(pid: str) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def vms(stack: Stack) -> list[Vm]:
    """QEMU processes carrying this stack's marker, by the CVM whose data disk they boot."""
    from umbra.emulated.qemu import EVENTS_SOCKET

    marker = f"UMBRA_UP_STATE={stack.state_dir}".encode()
    runtime_dir = str(stack.p(RUNTIME_DIR)) + "/"
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = _cmdline(proc.name)
            if not argv or Path(argv[0]).name != QEMU:
                continue
            if marker not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            continue
        cvm_id, qmp = "", None
        for arg in argv:
            if arg.startswith("file=" + runtime_dir) and arg.split(",")[0].endswith("/data.raw"):
                cvm_id = Path(arg.split(",")[0].removeprefix("file=")).parent.name
            if arg.startswith("unix:") and ",server" in arg:
                path = Path(arg.removeprefix("unix:").split(",")[0])
                qmp = qmp if path.name == EVENTS_SOCKET else path  # commands, not events
        found.append(Vm(int(proc.name), cvm_id, qmp))
    return found


def powerdown(qmp: Path) -> bool:
    """The ACPI power button over QMP (as a cloud's stop presses it); False if QMP is gone."""
    return _qmp(qmp, "system_powerdown")


def reset(qmp: Path) -> bool:
    """The reset button over QMP (as `gcloud compute instances reset` or `az vm restart`): the
    TD ends and the Console's provider boots a new one on the same disks (emulated.qemu,
    "Reboot"); False if QMP is gone."""
    return _qmp(qmp, "system_reset")


def _qmp(path: Path, command: str) -> bool:
    from umbra.emulated.qemu import qmp

    try:
        qmp(path, command, timeout=5)
        return True
    except OSError:
        return False


def stop_vms(stack: Stack, grace: float = STOP_GRACE) -> list[str]:
    """Every VM of this stack: power button, then SIGKILL after `grace` s. Returns what it
    stopped, each with how (`acpi` or `killed`)."""
    running = vms(stack)
    for vm in running:
        if vm.qmp is not None:
            powerdown(vm.qmp)
    end = time.monotonic() + grace
    alive = {vm.pid for vm in running}
    while alive and time.monotonic() < end:
        alive &= {vm.pid for vm in vms(stack)}
        time.sleep(0.2)
    stopped = []
    for vm in running:
        how = "acpi"
        if vm.pid in alive:
            how = "killed"
            with contextlib.suppress(ProcessLookupError):
                os.kill(vm.pid, signal.SIGKILL)
        stopped.append(f"qemu vm {vm.cvm_id or vm.pid} ({how})")
    if alive:
        end = time.monotonic() + 10
        while alive & {vm.pid for vm in vms(stack)} and time.monotonic() < end:
            time.sleep(0.1)
    return stopped


def status(stack: Stack, key: str = "dev_cvm_id") -> list[dict[str, Any]]:
    """The VM `umbra up` launched for the state's `key` (`dev_cvm_id`, `security_cvm_id`), as
    `umbra status` shows it: its QEMU and last boot."""
    cvm_id = stack.state.get(key)
    if not cvm_id:
        return []
    running = {vm.cvm_id: vm for vm in vms(stack)}
    vm = running.get(str(cvm_id))
    serials = sorted(
        stack.p(RUNTIME_DIR, str(cvm_id)).glob("serial-*.log"),
        key=lambda p: int(p.stem.split("-")[1]) if p.stem.split("-")[1].isdigit() else 0,
    )
    return [
        {
            "cvm_id": str(cvm_id),
            "runtime": "qemu",
            "shape": stack.state.get("shape", "gcp"),
            "accel": stack.state.get("accel"),
            "qemu_pid": vm.pid if vm else None,
            "serial": str(serials[-1]) if serials else None,
            "healthy": vm is not None,
        }
    ]
