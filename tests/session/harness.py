"""A minimal sandbox (user + network + mount + pid namespaces via `unshare`), the attested
ingress in front of it, and a Console that knows the Dev CVM: everything the session tests drive.

Names carry the prefix `uss-<pid>-<n>`; every process and directory is removed in `finally`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import simulated_boot_values

_counter = itertools.count()
UID_BASE = 300000 + (os.getpid() % 1000) * 65536 % 200000000  # host uids the sandbox maps to
SANDBOX_UID = 1000
IMAGE = "umbra-dev-cvm"


def require_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: user/network namespaces and a root gateway sshd (CI runs as root)")
    for tool, package in (
        ("sshd", "openssh-server"),
        ("ssh", "openssh-client"),
        ("dtach", "dtach"),
        ("unshare", "util-linux"),
        ("nsenter", "util-linux"),
    ):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            pytest.fail(f"{tool} is missing: run scripts/system-deps (apt {package})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def release_manifest(image: str = IMAGE, **extra: Any) -> dict[str, Any]:
    """The golden values of the simulated Dev CVM image: boot chain + a CVM id event."""
    return {
        "apiVersion": "umbra/v1",
        "kind": "ReleaseManifest",
        "name": image,
        "tee": "simulated",
        **simulated_boot_values(image),
        "events": [{"name": "umbra.cvm-id"}],
        **extra,
    }


@dataclass
class Sandbox:
    pid: int
    root: Path  # world-traversable scratch dir holding home/, sessions/, bin/
    uid_base: int

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def sessions(self) -> Path:
        return self.root / "sessions"

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def run(
        self, cmd: str, *, root: bool = False, timeout: float = 20
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` inside the sandbox as its user (or as root inside it)."""
        uid = "0" if root else str(SANDBOX_UID)
        argv = [
            "nsenter", "--target", str(self.pid), "--user", "--mount", "--pid", "--net",
            "--setuid", uid, "--setgid", uid, "--", "/bin/sh", "-c", cmd,
        ]  # fmt: skip
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)

    def spawn_in_net(self, argv: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["nsenter", f"--net=/proc/{self.pid}/ns/net", "--", *argv])


@contextmanager
def sandbox() -> Iterator[Sandbox]:
    n = next(_counter)
    root = Path(f"/tmp/uss-{os.getpid()}-{n}")
    base = UID_BASE + n * 65536
    proc: subprocess.Popen[bytes] | None = None
    try:
        root.mkdir(mode=0o755)
        for sub in ("home", "sessions", "bin"):
            (root / sub).mkdir(mode=0o755)
            os.chown(root / sub, base + SANDBOX_UID, base + SANDBOX_UID)
        proc = subprocess.Popen(
            ["unshare", "--user", "--net", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child",
             "--", "sleep", "infinity"],
            start_new_session=True,
        )  # fmt: skip
        child = _child_of(proc.pid)
        Path(f"/proc/{child}/uid_map").write_text(f"0 {base} 65536\n")
        Path(f"/proc/{child}/gid_map").write_text(f"0 {base} 65536\n")
        subprocess.run(
            ["nsenter", f"--net=/proc/{child}/ns/net", "--", "ip", "link", "set", "lo", "up"],
            check=True,
        )
        yield Sandbox(child, root, base)
    finally:
        if proc is not None:
            with _suppress():
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        # dtach masters of this sandbox die with its pid namespace (its init was killed)
        shutil.rmtree(root, ignore_errors=True)


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], ProcessLookupError)  # type: ignore[arg-type]


def _child_of(pid: int, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except FileNotFoundError:
            kids = []
        if kids:
            return int(kids[0])
        time.sleep(0.01)
    raise RuntimeError("unshare did not fork its child")


@dataclass
class IngressProc:
    port: int
    state_dir: Path
    launch_dir: Path
    proc: subprocess.Popen[bytes]
    config: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def write_ingress_config(
    box: Sandbox,
    work: Path,
    cvm_id: str,
    keys: list[str],
    pki_dir: Path,
    port: int,
    **extra: Any,
) -> Path:
    launch = work / "launch"
    launch.mkdir(mode=0o755, exist_ok=True)
    (launch / "cvm-id").write_text(cvm_id + "\n")
    (launch / "authorized_keys").write_text("\n".join(keys) + "\n")
    import json

    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "launch_dir": str(launch),
        "state_dir": str(work / "gateway"),
        "sandbox": {
            "pid": box.pid,
            "uid": SANDBOX_UID,
            "gid": SANDBOX_UID,
            "home": str(box.home),
            "path": f"{box.bin}:/usr/local/bin:/usr/bin:/bin",
            "sessions_dir": str(box.sessions),
        },
        "quote_source": {
            "kind": "simulated",
            "simulated_pki": str(pki_dir),
            "simulated_image": IMAGE,
        },
        **extra,
    }
    path = work / "ingress.json"
    path.write_text(json.dumps(config))
    return path


@contextmanager
def ingress(
    box: Sandbox, work: Path, cvm_id: str, keys: list[str], pki_dir: Path, **extra: Any
) -> Iterator[IngressProc]:
    port = free_port()
    config = write_ingress_config(box, work, cvm_id, keys, pki_dir, port, **extra)
    # Started as umbra-ingress.service starts it (Type=notify): ready is its READY=1 datagram,
    # which it sends once it listens (sandbox/sd_notify.py).
    # (An abstract socket, as systemd's may be: no path-length limit under a long tmp_path.)
    name = f"umbra-test-notify-{os.getpid()}-{port}"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind("\0" + name)
    notify.settimeout(0.2)
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "umbra"), "sandbox", "ingress", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        env={**os.environ, "NOTIFY_SOCKET": "@" + name},
    )
    running = IngressProc(port, work / "gateway", work / "launch", proc, config)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ingress exited with {proc.returncode}")
            with contextlib.suppress(TimeoutError):
                if notify.recv(64) == b"READY=1":
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("ingress sent no READY=1 within 30 s")
        with socket.socket() as s:  # ready means listening
            assert s.connect_ex(("127.0.0.1", port)) == 0, "READY=1 before the port listened"
        yield running
    finally:
        notify.close()
        running.stop()


def counting_sshd(directory: Path) -> tuple[Path, Path]:
    """An sshd that appends a line to a counter file each time it starts, then is the real one:
    tests read the counter to prove the gateway never started sshd for a refused session."""
    counter, wrapper = directory / "sshd-starts", directory / "sshd"
    real = shutil.which("sshd") or "/usr/sbin/sshd"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {counter}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, counter


def sshd_starts(counter: Path) -> int:
    """How many sshd ran for sessions (`-i`), not `sshd -t` checks."""
    try:
        return sum(" -i " in f" {line} " for line in counter.read_text().splitlines())
    except FileNotFoundError:
        return 0


def simulated_pki(directory: Path) -> Path:
    SimulatedPki.generate().save(directory)
    return directory


def keypair(directory: Path, name: str = "id_ed25519") -> tuple[Path, str]:
    key = directory / name
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True
    )
    return key, key.with_suffix(".pub").read_text().strip()


def unique_name() -> str:
    return f"uss{os.getpid() % 10000}-{next(_counter)}"


def stop_agents(tmpdir: Path) -> None:
    """End the warm ssh agents started under this TMPDIR (by their pid files), if any."""
    for pid_file in tmpdir.glob("umbra-ssh-*/agent-*.pid"):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
