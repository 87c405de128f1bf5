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


def write_hosts(etc: Path, security_cvm_ips: Sequence[str]) -> None:
    """The Dev CVM resolves nothing: the Security CVM's name is a static entry."""
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    lines += [f"{ip} {SECURITY_CVM_HOST}" for ip in security_cvm_ips]
    _replace(etc / "hosts", "\n".join(lines) + "\n")


def write_resolv_conf(etc: Path, resolvers: Sequence[str]) -> None:
    _replace(etc / "resolv.conf", "".join(f"nameserver {ip}\n" for ip in resolvers))


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".umbra-tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)
    if path.is_symlink():  # e.g. resolv.conf -> a resolver's stub file: ours replaces it
        path.unlink()
    tmp.replace(path)


class DataDisk(Protocol):
    def mount(self) -> str: ...


@dataclass(frozen=True)
class Ext4DataDisk:
    """The persistent disk: formatted (ext4) only when it carries no filesystem signature at all,
    so a disk with data, or with any other filesystem, is never formatted over."""

    device: Path
    mountpoint: Path
    label: str = "umbra-data"

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
        else:
            raise HostSetupError(f"blkid -p {dev} failed (exit {probe.returncode})")
        self.mountpoint.mkdir(parents=True, exist_ok=True, mode=0o755)
        if not os.path.ismount(self.mountpoint):
            _run(["mount", "-o", "nodev,nosuid", dev, str(self.mountpoint)], f"mount {dev}")
        return f"data disk {self.device} {what} at {self.mountpoint}"
