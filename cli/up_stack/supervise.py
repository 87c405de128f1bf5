"""The state directory and the processes started from it: lock, state file, spawn, stop, reap,
wait until a component answers, and the preflight before any of it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from umbra.cli.up_stack.errors import UpError
from umbra.cli.up_stack.names import COMPONENTS, PORTS, QEMU_ONLY, Port
from umbra.contracts.files import write_atomic

REQUIRED_TOOLS = {
    "ip": "iproute2",
    "nft": "nftables",
    "nsenter": "util-linux",
    "curl": "curl",
    # The attested SSH path: the gateway sshd, the client, host/login keys, agent sessions.
    "sshd": "openssh-server",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "dtach": "dtach",
    # The sandbox: its runtime, and what builds its image once (sandbox/image.py).
    "runc": "runc",
    "mmdebstrap": "mmdebstrap",
    "npm": "npm",
}


def umbra_executable() -> str:
    """The `umbra` of this interpreter's environment (each component runs the same install)."""
    return str(Path(sys.executable).parent / "umbra")


@dataclass
class Stack:
    state_dir: Path
    port_base: int
    progress: Callable[[str], None] = print
    state: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ paths and state
    def p(self, *parts: str) -> Path:
        return self.state_dir.joinpath(*parts)

    def load(self) -> None:
        try:
            self.state = json.loads(self.p("state.json").read_text())
        except (OSError, ValueError):
            self.state = {}
        self.port_base = int(self.state.get("port_base", self.port_base))

    def save(self) -> None:
        self.state["port_base"] = self.port_base
        write_atomic(self.p("state.json"), json.dumps(self.state, indent=2), 0o644)

    def port(self, which: Port | str) -> int:
        """The loopback port of `which` (a Port, or its name)."""
        return self.port_base + (which if isinstance(which, Port) else PORTS[which])

    @property
    def console_url(self) -> str:
        return f"http://127.0.0.1:{self.port(Port.CONSOLE)}"

    @property
    def issuer_url(self) -> str:
        return f"http://127.0.0.1:{self.port(Port.ISSUER)}"

    # ------------------------------------------------------------------ locking
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        handle = self.p("up.lock").open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            handle.close()
            raise UpError(
                f"another `umbra up` or `umbra down` is running on {self.state_dir} (pid {holder})",
                "wait for it to finish, or stop it",
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            handle.close()

    # ------------------------------------------------------------------ processes
    def pid(self, name: str) -> int | None:
        try:
            pid = int(self.p("run", f"{name}.pid").read_text())
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (OSError, ValueError):
            return None
        if f"UMBRA_UP_STATE={self.state_dir}".encode() not in environ.split(b"\0"):
            return None
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return None
        return pid

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        self.p("run").mkdir(exist_ok=True)
        self.p("logs").mkdir(exist_ok=True)
        log = self.p("logs", f"{name}.log").open("ab")
        full_env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": os.environ.get("HOME", "/root"),
            **(env or {}),
            "UMBRA_UP_STATE": str(self.state_dir),
        }
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=full_env,
            cwd=self.state_dir,
            start_new_session=True,
        )
        log.close()
        self.p("run", f"{name}.pid").write_text(str(proc.pid))
        # Until it has exec'd, the child still shows our environment (without the marker).
        end = time.monotonic() + 10
        while self.pid(name) is None and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.01)
        return proc.pid

    def stop(self, name: str) -> bool:
        pid = self.pid(name)
        if pid is None:
            self.p("run", f"{name}.pid").unlink(missing_ok=True)
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        end = time.monotonic() + 5
        while time.monotonic() < end and self.pid(name) is not None:
            time.sleep(0.05)
        if self.pid(name) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            time.sleep(0.1)
        self.p("run", f"{name}.pid").unlink(missing_ok=True)
        return True

    def reap_orphans(self) -> list[int]:
        """Kill what is left of a component whose main process died (kill -9 leaves its children
        holding its ports): any process carrying our marker outside a live component's group."""
        live = {pid for name in COMPONENTS if (pid := self.pid(name)) is not None}
        marker = f"UMBRA_UP_STATE={self.state_dir}".encode()
        reaped = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if marker not in (proc / "environ").read_bytes().split(b"\0"):
                    continue
                pgid = os.getpgid(int(proc.name))
            except (OSError, ProcessLookupError):
                continue
            if pgid not in live:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(proc.name), signal.SIGKILL)
                    reaped.append(int(proc.name))
        if reaped:
            time.sleep(0.2)
        return reaped

    def wait_http(self, name: str, url: str, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.pid(name) is None:
                raise UpError(f"{name} exited while starting: {self.log_tail(name)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise UpError(f"{name} did not answer {url} within {timeout:.0f}s: {self.log_tail(name)}")

    def wait_tcp(self, name: str, port: int, timeout: float = 90) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.pid(name) is None:
                raise UpError(f"{name} exited while starting: {self.log_tail(name)}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return
            time.sleep(0.1)
        raise UpError(f"{name} did not listen on port {port} within {timeout:.0f}s")

    def log_tail(self, name: str, chars: int = 600) -> str:
        with contextlib.suppress(OSError):
            return self.p("logs", f"{name}.log").read_text(errors="replace")[-chars:].strip()
        return "(no log)"


def preflight(stack: Stack) -> None:
    if os.geteuid() != 0:
        raise UpError(
            "umbra up needs root: it creates network and user namespaces for the Dev CVM",
            "run it as root (sudo ./scripts/up)",
        )
    tools = dict(REQUIRED_TOOLS)
    if stack.state.get("runtime") == "qemu":
        from umbra.cli.up_stack import qemu

        qemu.preflight()
        tools = {k: v for k, v in tools.items() if k not in qemu.SANDBOX_ONLY_TOOLS}
    missing = sorted({pkg for tool, pkg in tools.items() if shutil.which(tool) is None})
    if missing:
        raise UpError(
            f"missing system packages: {', '.join(missing)}", "run ./scripts/system-deps as root"
        )
    stack.reap_orphans()
    for port in Port:
        if port.owner in QEMU_ONLY and stack.state.get("runtime") != "qemu":
            continue
        if port is Port.TUNNEL or stack.pid(port.owner) is not None:
            continue
        with socket.socket() as sock:
            # As the servers do: TIME_WAIT leftovers of a killed component do not count.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", stack.port(port)))
            except OSError:
                raise UpError(
                    f"port {stack.port(port)} ({port.label}) is in use by another program",
                    "stop that program, or pick other ports with --port-base",
                ) from None
