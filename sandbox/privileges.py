"""Dropping host root once a process has done what needs it (the forwarder: enroll, read its
credential, bind its listeners), for good: no supplementary groups, real/effective/saved ids all
the unprivileged uid, no capabilities left, no_new_privs set, and a check that root cannot be had
back. glibc applies setresuid/setresgid/setgroups to every thread of the process."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

_PR_SET_NO_NEW_PRIVS = 38


class PrivilegeError(Exception):
    """Privileges could not be dropped; the message says which step (the caller stops)."""


def effective_caps(status: str | None = None) -> int:
    """CapEff of this process (or of a /proc/PID/status text)."""
    text = status if status is not None else Path("/proc/self/status").read_text()
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    raise PrivilegeError("no CapEff line in /proc/self/status")


def drop_to(uid: int) -> None:
    """Become `uid` (and the group of the same number) for the rest of this process's life."""
    if uid <= 0:
        raise PrivilegeError(f"refusing to run as uid {uid}: not an unprivileged id")
    try:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    except OSError as exc:
        raise PrivilegeError(f"cannot become uid {uid}: {exc.strerror}") from None
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise PrivilegeError(f"prctl(NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        raise PrivilegeError("root could be regained after the drop")
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid) or os.getgroups():
        raise PrivilegeError(f"ids after the drop are not all {uid}")
    if effective_caps():
        raise PrivilegeError("capabilities remain after the drop")
