"""Idmapped bind mounts (mount_setattr(2) MOUNT_ATTR_IDMAP): one cached image tree, owned by the
host's root on disk, seen through a mount as owned by a sandbox's unprivileged uid range.

Why: the sandbox's root is host uid B (B..B+65535 mapped). A tree owned by 0 would appear to it
as `nobody`, so `sudo`, `apt` and every setuid bit would break; copying and chowning the ~1.5 GB
image per sandbox would cost tens of seconds per launch. An idmapped mount of the one cached
tree costs nothing, and the tree on disk stays the host root's, read-only to every sandbox (the
overlay's upper directory takes the writes).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

_LIBC = ctypes.CDLL(None, use_errno=True)
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442
_OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_MOUNT_ATTR_RDONLY = 0x1
_MOUNT_ATTR_IDMAP = 0x100000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4


class IdmapError(Exception):
    """The kernel or the file system refused an idmapped mount; the message says which step."""


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise IdmapError(f"{what}: {os.strerror(err)}")
    return result


@contextlib.contextmanager
def _userns(base: int, count: int) -> Iterator[int]:
    """An fd of a user namespace mapping 0..count-1 to base..base+count-1: a parked `unshare -U`
    child's (a spawned program, not a fork: the caller may be a multi-threaded server)."""
    ours = os.readlink("/proc/self/ns/user")
    child = subprocess.Popen(
        ["unshare", "--user", "--", "sleep", "60"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{child.pid}/ns/user") != ours:
                    break
            if child.poll() is not None or time.monotonic() > end:
                raise IdmapError("could not create a user namespace for the idmapped mount")
            time.sleep(0.005)
        Path(f"/proc/{child.pid}/uid_map").write_text(f"0 {base} {count}\n")
        Path(f"/proc/{child.pid}/setgroups").write_text("deny\n")
        Path(f"/proc/{child.pid}/gid_map").write_text(f"0 {base} {count}\n")
        fd = os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)
    finally:
        child.kill()
        child.wait()


def mount_idmapped(source: Path, target: Path, base: int, count: int) -> None:
    """Bind `source` (recursively) on `target`, read-only, ids shifted by `base`."""
    tree = _check(
        _LIBC.syscall(
            _SYS_OPEN_TREE,
            _AT_FDCWD,
            str(source).encode(),
            _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_RECURSIVE,
        ),
        f"open_tree {source}",
    )
    try:
        with _userns(base, count) as userns_fd:
            attr = _MountAttr(_MOUNT_ATTR_IDMAP | _MOUNT_ATTR_RDONLY, 0, 0, userns_fd)
            _check(
                _LIBC.syscall(
                    _SYS_MOUNT_SETATTR,
                    tree,
                    b"",
                    _AT_EMPTY_PATH | _AT_RECURSIVE,
                    ctypes.byref(attr),
                    ctypes.sizeof(attr),
                ),
                f"idmapped mount of {source} (the file system must support idmapped mounts)",
            )
        _check(
            _LIBC.syscall(
                _SYS_MOVE_MOUNT,
                tree,
                b"",
                _AT_FDCWD,
                str(target).encode(),
                _MOVE_MOUNT_F_EMPTY_PATH,
            ),
            f"move_mount onto {target}",
        )
    finally:
        os.close(tree)
