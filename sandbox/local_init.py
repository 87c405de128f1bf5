"""Start a local Dev CVM's sandbox process: `python -m umbra.sandbox.local_init PLAN.json` (root).

Steps, in this order because each needs the previous one's privileges:
1. join the sandbox network namespace (made by `local_cvm.create_network`);
2. fork a child that unshares user, mount, PID, UTS and IPC namespaces; we (host root) write its
   uid/gid maps: sandbox root = the plan's unprivileged host uid, 65536 ids, nothing else mapped;
3. the child forks PID 1 of the new PID namespace, which (still host-uid 0 on files, so it can
   reach the root-only CVM directory) bind-mounts the host's userland read-only into the CVM's
   tree, mounts /proc, chroots there, then becomes sandbox root and execs `sleep infinity`.
The sandbox's host pid goes to `sandbox.pid`; `nsenter -t PID` runs commands inside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import sys
from pathlib import Path

from umbra.sandbox.local_cvm import HOST_DIRS, UID_COUNT, LocalCvmPlan

_FLAGS = os.CLONE_NEWUSER | os.CLONE_NEWNS | os.CLONE_NEWPID | os.CLONE_NEWUTS | os.CLONE_NEWIPC


_LIBC = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18


def _mount(source: str, target: str, fstype: str | None, flags: int) -> None:
    """mount(2) directly: util-linux mount(8) refuses a uid it does not see as 0."""
    if _LIBC.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                   flags, None) != 0:  # fmt: skip
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _pid1(plan: LocalCvmPlan) -> None:
    root = plan.rootfs
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    for sub in HOST_DIRS:
        source = Path("/") / sub
        if not source.is_dir() or source.is_symlink():
            # usrmerge: /bin -> usr/bin and friends become symlinks in the tree too.
            target = root / sub
            if source.is_symlink() and not target.is_symlink():
                target.rmdir()
                target.symlink_to(os.readlink(source))
            continue
        where = str(root / sub)
        _mount(str(source), where, None, MS_BIND | MS_REC)
        _mount("none", where, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _mount("/dev", str(root / "dev"), None, MS_BIND | MS_REC)
    # A host that masks parts of /proc refuses new proc mounts in a user namespace.
    with contextlib.suppress(OSError):
        _mount("proc", str(root / "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    socket.sethostname("umbra-dev")
    os.chroot(root)
    os.chdir("/root")
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": "/root",
        "UMBRA_LOCAL_CVM": plan.cvm_id,
        "LANG": "C.UTF-8",
    }
    os.execve("/usr/bin/sleep", ["sleep", "infinity"], env)  # noqa: S606 -- no shell wanted


def main(plan_path: str) -> int:
    plan = LocalCvmPlan(**json.loads(Path(plan_path).read_text()))
    fd = os.open(f"/run/netns/{plan.sandbox_ns}", os.O_RDONLY)
    os.setns(fd, os.CLONE_NEWNET)
    os.close(fd)
    unshared_r, unshared_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    pid_r, pid_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.unshare(_FLAGS)
        os.write(unshared_w, b"1")
        os.read(mapped_r, 1)
        init = os.fork()
        if init == 0:
            try:
                _pid1(plan)
            except BaseException as exc:  # the launcher's log is the only place to say why
                sys.stderr.write(f"sandbox init failed: {exc!r}\n")
                sys.stderr.flush()
            os._exit(1)
        os.write(pid_w, str(init).encode())
        os.waitpid(init, 0)
        os._exit(0)
    if os.read(unshared_r, 1) != b"1":
        return 1
    Path(f"/proc/{child}/uid_map").write_text(f"0 {plan.uid} {UID_COUNT}\n")
    Path(f"/proc/{child}/gid_map").write_text(f"0 {plan.uid} {UID_COUNT}\n")
    os.write(mapped_w, b"1")
    init_pid = int(os.read(pid_r, 32))
    (plan.dir / "sandbox.pid").write_text(str(init_pid))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
