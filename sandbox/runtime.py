"""The sandbox runtime: runc (Debian package `runc`) driving one OCI bundle per sandbox.

    image layers (cached, host root's) --idmapped ro binds--> /run/umbra-sandbox/ID/layerN
    overlay(lower=layer0:layer1, upper=UPPER)            --> /run/umbra-sandbox/ID/rootfs
    runc: new user (0 -> B..B+65535), mount, PID, UTS, IPC, cgroup and network namespaces
          (the network namespace belongs to the sandbox's user namespace, so its nested dockerd
          can make bridges and NAT rules; its one link is attached by the host between
          `runc create` and `runc start`: `start(on_created=...)`)

Why runc rather than Podman, LXC or Incus (docs/specs/sandbox.md has the long form): it is the
one component all of them end in, it is already in every image that carries docker.io, it lets
the host wire the sandbox's network namespace before its first process runs (the topology that
isolates the sandbox stays ours), and it needs no daemon, image store or import: the rootfs is
a directory, so a start takes well under a second.

Mounts are made here by the host's root, under a directory only root can write but the
sandbox's root can traverse (runc prepares the rootfs from inside the new user namespace).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from umbra.sandbox.idmap import mount_idmapped

RUN_ROOT = Path("/run/umbra-sandbox")
CGROUP_PARENT = "umbra-sandbox"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Bit numbers of capabilities (linux/capability.h), for the bounding set we may hand on.
_CAPS = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
]
MOUNT_FLAGS = ("nosuid", "noexec", "nodev")


class RuntimeError_(Exception):
    """The sandbox could not be prepared, started or stopped; the message says why."""


def require_runtime() -> str:
    path = shutil.which("runc")
    if path is None:
        raise RuntimeError_(
            "the sandbox runtime is missing: apt-get install runc (or ./scripts/system-deps)"
        )
    return path


@dataclass(frozen=True)
class Bind:
    source: Path
    target: str  # inside the sandbox
    read_only: bool = True


@dataclass(frozen=True)
class SandboxSpec:
    """One sandbox: everything runc is told, nothing it guesses."""

    name: str  # the container id (unique on the host)
    base_uid: int  # sandbox root's host uid; 65536 ids mapped
    # None: runc makes a network namespace owned by the sandbox's user namespace (nested Docker
    # can make its bridge and NAT there; the host attaches the one link at `on_created`). A path:
    # joined, owned by the host's user namespace (the sandbox's root cannot change it at all, and
    # nested containers get loopback only).
    netns: Path | None
    image: tuple[Path, ...]  # the cached layers, top first (read-only)
    upper: Path  # the sandbox's writes (survive a stop)
    work: Path  # overlay's work dir, same file system as upper
    state: Path  # runc's --root (host root only)
    args: tuple[str, ...]
    env: tuple[str, ...] = ()
    binds: tuple[Bind, ...] = ()
    hostname: str = "umbra-dev"
    id_count: int = 65536
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return RUN_ROOT / self.name

    @property
    def rootfs(self) -> Path:
        return self.run_dir / "rootfs"

    @property
    def cgroups_path(self) -> str:
        return f"/{CGROUP_PARENT}/{self.name}"


def _bounding_caps() -> list[str]:
    """Every capability we hold in our bounding set (a session may lack SYS_RESOURCE)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            mask = int(line.split()[1], 16)
            return [f"CAP_{name}" for bit, name in enumerate(_CAPS) if mask >> bit & 1]
    return []


def _nofile() -> int:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20


def cgroup_v2() -> bool:
    return (CGROUP_ROOT / "cgroup.controllers").exists()


def oci_config(spec: SandboxSpec) -> dict[str, Any]:
    """The bundle's config.json. Privileged inside its user namespace (no seccomp filter, no
    masked /proc: a nested runc must be able to mount a fresh proc), nothing outside it."""
    caps = _bounding_caps()
    idmap = [{"containerID": 0, "hostID": spec.base_uid, "size": spec.id_count}]
    nofile = _nofile()
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(spec.args),
            "env": [
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME=/root",
                "LANG=C.UTF-8",
                *spec.env,
            ],
            "cwd": "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}],
            "noNewPrivileges": False,
        },
        "root": {"path": str(spec.rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            {
                "destination": "/proc",
                "type": "proc",
                "source": "proc",
                "options": list(MOUNT_FLAGS),
            },
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            },
            {
                "destination": "/dev/shm",  # noqa: S108 -- inside the sandbox
                "type": "tmpfs",
                "source": "shm",
                "options": [*MOUNT_FLAGS, "mode=1777", "size=262144k"],
            },
            {
                "destination": "/dev/mqueue",
                "type": "mqueue",
                "source": "mqueue",
                "options": list(MOUNT_FLAGS),
            },
            _sys_mount(spec),
            # Writable: the nested dockerd makes its containers' cgroups under ours.
            {
                "destination": "/sys/fs/cgroup",
                "type": "cgroup",
                "source": "cgroup",
                "options": [*MOUNT_FLAGS, "relatime", "rw"],
            },
        ],
        "linux": {
            "uidMappings": idmap,
            "gidMappings": idmap,
            "namespaces": [
                {"type": "pid"},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
                {"type": "user"},
                {"type": "cgroup"},
                _netns(spec),
            ],
            "cgroupsPath": spec.cgroups_path,
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "rootfsPropagation": "rprivate",
        },
    }


def _netns(spec: SandboxSpec) -> dict[str, str]:
    if spec.netns is None:
        return {"type": "network"}
    return {"type": "network", "path": str(spec.netns)}


def _sys_mount(spec: SandboxSpec) -> dict[str, Any]:
    """A sysfs of the sandbox's own network namespace (its dockerd reads its bridge there); with a
    joined host-owned namespace, sysfs cannot be mounted from the sandbox's user namespace, so the
    host's is bound read-only (runc does the same for rootless containers)."""
    if spec.netns is None:
        return {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": [*MOUNT_FLAGS, "rw"],
        }
    return {
        "destination": "/sys",
        "type": "none",
        "source": "/sys",
        "options": ["rbind", "nosuid", "noexec", "nodev", "ro"],
    }


# ----------------------------------------------------------------------------- mounts


def _mounted(path: Path) -> bool:
    target = str(path)
    return any(
        line.split()[4] == target for line in Path("/proc/self/mountinfo").read_text().splitlines()
    )


def _run(argv: list[str], what: str, timeout: float = 60) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError_(f"{what}: no answer within {timeout:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError_(f"{what}: {(done.stderr or done.stdout).strip()[-400:]}")
    return done.stdout


def mount_rootfs(spec: SandboxSpec) -> None:
    """The idmapped image, the overlay over it, and the binds inside it (idempotent)."""
    RUN_ROOT.mkdir(mode=0o711, exist_ok=True)
    spec.run_dir.mkdir(mode=0o711, exist_ok=True)
    rootfs = spec.rootfs
    layers = [spec.run_dir / f"layer{i}" for i in range(len(spec.image))]
    for d in (*layers, rootfs):
        d.mkdir(exist_ok=True)
    for d in (spec.upper, spec.work):
        d.mkdir(parents=True, exist_ok=True, mode=0o755)
    if _mounted(rootfs):
        return
    for source, layer in zip(spec.image, layers, strict=True):
        if not _mounted(layer):
            mount_idmapped(source, layer, spec.base_uid, spec.id_count)
    # The upper dir's root must be the sandbox root's, as the image's / is through the idmap.
    os.chown(spec.upper, spec.base_uid, spec.base_uid)
    _run(
        ["mount", "-t", "overlay", "overlay", "-o",
         f"lowerdir={':'.join(map(str, layers))},upperdir={spec.upper},workdir={spec.work}",
         str(rootfs)],
        "mounting the sandbox's overlay",
    )  # fmt: skip
    for bind in spec.binds:
        target = rootfs / bind.target.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        _run(["mount", "--bind", str(bind.source), str(target)], f"binding {bind.target}")
        if bind.read_only:
            _run(
                ["mount", "-o", "remount,bind,ro,nosuid,nodev", str(target)],
                f"making {bind.target} read-only",
            )


def unmount_rootfs(spec: SandboxSpec) -> None:
    layers = sorted(spec.run_dir.glob("layer*")) if spec.run_dir.exists() else []
    for path in (spec.rootfs, *layers):
        # Lazy and recursive: a session still holding a cwd in it must not keep it.
        while _mounted(path):
            subprocess.run(["umount", "-R", "-l", str(path)], capture_output=True, check=False)
    if spec.run_dir.exists():
        shutil.rmtree(spec.run_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- lifecycle


def _runc(spec: SandboxSpec, *args: str, timeout: float = 60) -> str:
    return _run([require_runtime(), "--root", str(spec.state), *args], f"runc {args[0]}", timeout)


def state(spec: SandboxSpec) -> dict[str, Any] | None:
    if not (spec.state / spec.name).exists():
        return None
    done = subprocess.run(
        [require_runtime(), "--root", str(spec.state), "state", spec.name],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        return None
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _delegate_cgroups(spec: SandboxSpec) -> None:
    """Hand the sandbox's own cgroups to its root, so its dockerd can make children there.

    cgroup v1: every hierarchy's directory and files. cgroup v2 (the CVM's kernel): the
    directory and the three files the kernel's delegation model names (cgroup.procs,
    cgroup.subtree_control, cgroup.threads); not run here (this host is hybrid v1)."""
    uid = spec.base_uid
    if cgroup_v2():
        base = CGROUP_ROOT / spec.cgroups_path.lstrip("/")
        paths = [base] + [
            base / f for f in ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads")
        ]
    else:
        paths = []
        for hierarchy in CGROUP_ROOT.iterdir():
            base = hierarchy / spec.cgroups_path.lstrip("/")
            if hierarchy.name != "unified" and base.is_dir():
                paths.append(base)
                paths.extend(base.iterdir())
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.chown(path, uid, uid)


def start(
    spec: SandboxSpec, pid_file: Path, on_created: Callable[[int], None] | None = None
) -> int:
    """Create and start the container; its init's host pid goes to `pid_file`.

    `on_created(pid)` runs between `runc create` and `runc start`: the namespaces exist, nothing
    of the sandbox's has run yet (the host attaches its network link there). If it fails, the
    container is deleted and the error propagates."""
    require_runtime()
    spec.state.mkdir(parents=True, exist_ok=True, mode=0o700)
    if state(spec) is not None:
        delete(spec)
    mount_rootfs(spec)
    bundle = spec.run_dir / "bundle"
    bundle.mkdir(mode=0o700, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(oci_config(spec), indent=2))
    log = spec.state / "init.log"
    pid_file.unlink(missing_ok=True)
    offset = log.stat().st_size if log.exists() else 0
    with log.open("ab") as out:
        # Detached: the container's init keeps runc's stdio, so both go to the log (a pipe
        # would never reach EOF); runc's own errors land there too.
        done = subprocess.run(
            [require_runtime(), "--root", str(spec.state), "--log", str(spec.state / "runc.log"),
             "create", "--bundle", str(bundle), "--pid-file", str(pid_file), spec.name],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=60,
        )  # fmt: skip
    if done.returncode != 0:
        with log.open("rb") as f:
            f.seek(offset)
            said = f.read().decode(errors="replace").strip()
        raise RuntimeError_(f"runc create: {said[-400:]}")
    pid = int(pid_file.read_text().strip())
    try:
        _delegate_cgroups(spec)
        if on_created is not None:
            on_created(pid)
        _runc(spec, "start", spec.name)
    except BaseException:
        with contextlib.suppress(RuntimeError_, OSError, subprocess.SubprocessError):
            delete(spec)
        raise
    return pid


def delete(spec: SandboxSpec) -> None:
    """Kill every process of the sandbox and remove the container (not its files)."""
    if state(spec) is None:
        return
    subprocess.run(
        [require_runtime(), "--root", str(spec.state), "kill", "--all", spec.name, "KILL"],
        capture_output=True,
        timeout=30,
    )
    end = time.monotonic() + 10
    while time.monotonic() < end:
        done = subprocess.run(
            [require_runtime(), "--root", str(spec.state), "delete", "--force", spec.name],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode == 0 or state(spec) is None:
            return
        time.sleep(0.1)
    raise RuntimeError_(f"runc delete {spec.name}: {done.stderr.strip()[-300:]}")
