"""What the launch agent configures on the CVM host itself, after measuring and before any
container starts: the host firewall (nftables), /etc/hosts or resolv.conf, the data disk.

Each step is a small seam (a Protocol) so tests drive the real tools (nft in a network namespace,
mkfs/mount on a loop device) without touching the machine's own configuration.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from umbra.components.ports import SECURITY_CVM_HOST
from umbra.contracts.files import write_atomic


class HostSetupError(Exception):
    """A host step failed; the message says which and why (the agent refuses to start)."""


def _run(cmd: Sequence[str], what: str, stdin: str | None = None) -> str:
    try:
        done = subprocess.run(
            list(cmd), input=stdin, capture_output=True, text=True, check=False, timeout=120
        )
    except OSError as exc:
        raise HostSetupError(f"{what}: {cmd[0]}: {exc.strerror}") from None
    if done.returncode != 0:
        tail = " / ".join((done.stderr or done.stdout).strip().splitlines()[-4:])
        raise HostSetupError(f"{what} failed (exit {done.returncode}): {tail}")
    return done.stdout


class Firewall(Protocol):
    def load(self, ruleset: str) -> None: ...


@dataclass(frozen=True)
class Nft:
    """`nft -f -`: the ruleset replaces its own table in one transaction (all or nothing)."""

    argv: tuple[str, ...] = ("nft",)

    def load(self, ruleset: str) -> None:
        _run([*self.argv, "-f", "-"], "nft -f (umbra-host-firewall)", stdin=ruleset)


@dataclass(frozen=True)
class LocalRoutes:
    """`ip route replace local ADDR/32 dev lo table local`. A passthrough load balancer (GCP's
    internal and external ones) hands the VM packets still addressed to the balancer's address;
    Google's guest agent, which the image does not run, is what normally adds this route. Without
    it the kernel does not take those packets as its own and drops them (forwarding is off), so a
    replica behind the balancer answers its health check on its own address and nothing else."""

    argv: tuple[str, ...] = ("ip",)

    def add(self, address: str) -> None:
        _run(
            [
                *self.argv,
                "route",
                "replace",
                "local",
                f"{address}/32",
                "dev",
                "lo",
                "table",
                "local",
            ],
            f"local route for the load balancer's {address}",
        )


def write_hosts(etc: Path, security_cvm_ips: Sequence[str]) -> None:
    """The Dev CVM resolves nothing: the Security CVM's name is a static entry."""
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    lines += [f"{ip} {SECURITY_CVM_HOST}" for ip in security_cvm_ips]
    _replace(etc / "hosts", "\n".join(lines) + "\n")


def write_resolv_conf(etc: Path, resolvers: Sequence[str]) -> None:
    _replace(etc / "resolv.conf", "".join(f"nameserver {ip}\n" for ip in resolvers))


def _replace(path: Path, text: str) -> None:
    if path.is_symlink():  # e.g. resolv.conf -> a resolver's stub file: ours replaces it
        path.unlink()
    write_atomic(path, text, 0o644)


class DataDisk(Protocol):
    def mount(self) -> str: ...


@dataclass(frozen=True)
class Ext4DataDisk:
    """The persistent disk: formatted (ext4) only when it carries no filesystem signature at all,
    so a disk with data, or with any other filesystem, is never formatted over; on every later
    boot, before it is mounted, grown to the device's size when the device is larger."""

    device: Path
    mountpoint: Path
    label: str = "umbra-data"
    resize2fs: tuple[str, ...] = ("resize2fs",)

    def mount(self) -> str:
        if not self.device.exists():
            raise HostSetupError(f"data disk {self.device} is not attached")
        dev = str(self.device.resolve())
        probe = subprocess.run(
            ["blkid", "-p", "-o", "value", "-s", "TYPE", dev],
            capture_output=True,
            text=True,
            check=False,
        )
        grown = ""
        # blkid -p: exit 2 means no signature found; anything else non-zero is an error.
        if probe.returncode == 2:
            _run(["mkfs.ext4", "-q", "-L", self.label, dev], f"mkfs.ext4 {dev}")
            what = "formatted (it was empty) and mounted"
        elif probe.returncode == 0:
            if probe.stdout.strip() != "ext4":
                raise HostSetupError(
                    f"data disk {dev} holds {probe.stdout.strip() or 'an unknown'} filesystem, "
                    "not ext4: refusing to mount or format it"
                )
            what = "mounted"
            if not os.path.ismount(self.mountpoint):
                grown = self._grow(dev)
        else:
            raise HostSetupError(f"blkid -p {dev} failed (exit {probe.returncode})")
        self.mountpoint.mkdir(parents=True, exist_ok=True, mode=0o755)
        if not os.path.ismount(self.mountpoint):
            _run(["mount", "-o", "nodev,nosuid", dev, str(self.mountpoint)], f"mount {dev}")
        return f"data disk {self.device} {what} at {self.mountpoint}{grown}"

    def _grow(self, dev: str) -> str:
        """Grow the ext4 to the device's size when the disk was grown (the Console's `PATCH
        /cvms/{id} {"data_disk_gb"}`), before it is mounted: `e2fsck -f -p` then `resize2fs`,
        the offline path resize2fs itself asks for (it checks the filesystem before changing
        its metadata; the online ioctl also needs CAP_SYS_RESOURCE). Never fatal: a failed grow
        leaves the filesystem as it was, so the developer keeps their workspace at the old size;
        refusing the boot would lock them out of it over spare space. The outcome is part of the
        mount's one serial line."""
        try:
            device_bytes = _device_bytes(dev)
            fs_bytes = _ext4_bytes(dev)
            if device_bytes - fs_bytes < GROW_THRESHOLD:
                return ""
            _fsck(dev)
            _run([*self.resize2fs, dev], f"resize2fs {dev}")
            grown = _ext4_bytes(dev)
        except HostSetupError as exc:
            return f"; WARNING filesystem not grown, it keeps its size: {exc}"
        return f"; filesystem grown from {fs_bytes >> 20} MiB to {grown >> 20} MiB"


def _fsck(dev: str) -> None:
    """`e2fsck -f -p`: exit 0 clean, 1 errors fixed; anything else leaves it for a human."""
    try:
        done = subprocess.run(
            ["e2fsck", "-f", "-p", dev], capture_output=True, text=True, check=False, timeout=600
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostSetupError(f"e2fsck -f -p {dev}: {exc}") from None
    if done.returncode not in (0, 1):
        tail = " / ".join((done.stderr or done.stdout).strip().splitlines()[-2:])
        raise HostSetupError(f"e2fsck -f -p {dev} failed (exit {done.returncode}): {tail}")


# Less than this between the device and the filesystem is not a grown disk: ext4 rounds its
# size down to whole blocks (and resize2fs to whole block groups' worth at the end).
GROW_THRESHOLD = 1 << 20


def _device_bytes(dev: str) -> int:
    try:
        fd = os.open(dev, os.O_RDONLY)
    except OSError as exc:
        raise HostSetupError(f"open {dev}: {exc.strerror}") from None
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def _ext4_bytes(dev: str) -> int:
    """The filesystem's size from its superblock (`dumpe2fs -h`, fine while mounted)."""
    out = _run(["dumpe2fs", "-h", dev], f"dumpe2fs -h {dev}")
    fields = dict(ln.split(":", 1) for ln in out.splitlines() if ":" in ln)
    try:
        return int(fields["Block count"]) * int(fields["Block size"])
    except (KeyError, ValueError):
        raise HostSetupError(f"dumpe2fs -h {dev}: no block count or size") from None


# ---- finding the data disk without the clouds' udev rules ------------------------------------
# Google's guest rules (by-id/google-<device name>) and waagent's (disk/azure/scsi1/lunN) are
# not in the image, so those names never exist. The disk is found from sysfs: a whole disk that
# is not virtual, not removable, not read-only, has no partitions and no holders (the boot disk
# has the ESP, root and verity partitions; an Azure resource disk is partitioned NTFS). Exactly
# one such disk must be labelled `umbra-data` (a later boot) or, with none labelled, exactly one
# must exist (the first boot, blank): anything else is ambiguous and refused.
VIRTUAL_PREFIXES = ("loop", "ram", "zram", "dm-", "sr", "md", "nbd", "fd", "zd")


class Probe(Protocol):
    def __call__(self, device: Path) -> tuple[str, str]: ...


def blkid_probe(device: Path) -> tuple[str, str]:
    """(TYPE, LABEL) of a device's signature, ("", "") when it has none (blkid -p exit 2)."""
    done = subprocess.run(
        ["blkid", "-p", "-o", "export", str(device)], capture_output=True, text=True, check=False
    )
    if done.returncode == 2:
        return "", ""
    if done.returncode != 0:
        raise HostSetupError(f"blkid -p {device} failed (exit {done.returncode})")
    tags = dict(ln.split("=", 1) for ln in done.stdout.splitlines() if "=" in ln)
    return tags.get("TYPE", ""), tags.get("LABEL", "")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def data_disk_candidates(sys_block: Path) -> list[str]:
    """Whole disks that could be the data disk, by name, sorted."""
    out = []
    for entry in sorted(sys_block.iterdir()) if sys_block.is_dir() else []:
        name = entry.name
        if name.startswith(VIRTUAL_PREFIXES):
            continue
        if _read(entry / "removable") == "1" or _read(entry / "ro") == "1":
            continue
        if _read(entry / "size") in ("", "0"):
            continue
        if any((child / "partition").exists() for child in entry.iterdir() if child.is_dir()):
            continue  # partitioned: the boot disk (or a disk we did not make)
        holders = entry / "holders"
        if holders.is_dir() and any(holders.iterdir()):
            continue  # in use by device-mapper or md
        out.append(name)
    return out


def find_data_disk(
    sys_block: Path = Path("/sys/block"),
    dev_dir: Path = Path("/dev"),
    probe: Probe = blkid_probe,
    label: str = "umbra-data",
) -> Path:
    names = data_disk_candidates(sys_block)
    if not names:
        raise HostSetupError("no data disk: no unpartitioned, writable, non-removable disk")
    found = {name: probe(dev_dir / name) for name in names}
    labelled = [n for n, (kind, lab) in found.items() if kind == "ext4" and lab == label]
    if len(labelled) == 1:
        return dev_dir / labelled[0]
    if len(labelled) > 1:
        raise HostSetupError(f"data disk ambiguous: {', '.join(labelled)} are all {label!r}")
    if len(names) > 1:
        described = ", ".join(f"{n} ({found[n][0] or 'blank'})" for n in names)
        raise HostSetupError(f"data disk ambiguous: none labelled {label!r} among {described}")
    return dev_dir / names[0]


@dataclass(frozen=True)
class DiscoveredDataDisk:
    """The data disk found in sysfs at mount time (find_data_disk), then Ext4DataDisk's rules:
    formatted (label `umbra-data`) only when blank, refused when it holds anything else."""

    mountpoint: Path
    sys_block: Path = Path("/sys/block")
    dev_dir: Path = Path("/dev")
    probe: Probe = blkid_probe

    resize2fs: tuple[str, ...] = ("resize2fs",)

    def mount(self) -> str:
        device = find_data_disk(self.sys_block, self.dev_dir, self.probe)
        return Ext4DataDisk(device, self.mountpoint, resize2fs=self.resize2fs).mount()
