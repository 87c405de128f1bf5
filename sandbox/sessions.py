"""Agent sessions under dtach: a dropped SSH connection detaches, the next one reattaches the
same process.

Two halves, because sshd does not run in the sandbox (a root-in-sandbox agent must not control
who may log in):
- the **launcher** runs inside the sandbox as the sandbox user and starts agents with
  `dtach -n` on sockets in the shared sessions directory, on request over `launcher.sock`;
- the **session helper** is sshd's ForceCommand: it asks the launcher for a session, then
  attaches with `dtach -a`. Only fixed agent names can be asked for, never a command line.

Request (one JSON line): {"agent": "claude" | "codex" | "shell", "name": "<session>"}
Reply   (one JSON line): {"ok": true, "socket": "<path>"} | {"ok": false, "error": "..."}
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

# Permission prompts off: the sandbox is the boundary, not a prompt (docs/specs/session.md).
AGENTS: Mapping[str, tuple[str, ...]] = {
    "claude": ("claude", "--dangerously-skip-permissions"),
    "codex": ("codex", "--dangerously-bypass-approvals-and-sandbox"),
    "shell": ("bash", "-l"),
}
DEFAULT_AGENT = "shell"
DEFAULT_NAME = "main"
LAUNCHER_SOCKET = "launcher.sock"
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
MAX_REQUEST = 1024
# -E: no detach key (the agent gets every keystroke; a dropped connection detaches);
# -z: ^Z goes to the agent; -r winch: redraw by resizing on reattach.
DTACH_OPTS = ("-E", "-z", "-r", "winch")


class SessionError(Exception):
    """A session cannot be started or attached; the message says why."""


def parse_request(command: str | None) -> tuple[str, str]:
    """`SSH_ORIGINAL_COMMAND` → (agent, session name). Empty means the default shell."""
    words = shlex.split(command or "")
    if len(words) > 2:
        raise SessionError("usage: ssh <cvm> [claude|codex|shell] [session-name]")
    agent = words[0] if words else DEFAULT_AGENT
    name = words[1] if len(words) > 1 else DEFAULT_NAME
    check_request(agent, name)
    return agent, name


def check_request(agent: str, name: str, agents: Mapping[str, Sequence[str]] = AGENTS) -> None:
    if agent not in agents:
        raise SessionError(f"unknown agent {agent!r}; choose one of {', '.join(sorted(agents))}")
    if not _NAME.match(name):
        raise SessionError(f"session name {name!r} must match {_NAME.pattern}")


def socket_path(sessions: Path, agent: str, name: str) -> Path:
    return sessions / f"{agent}-{name}.dtach"


def is_alive(sock: Path) -> bool:
    """A dtach master is listening on `sock`; a stale socket file counts as dead."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(sock))
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
            return False
        raise SessionError(f"cannot probe {sock}: {exc.strerror}") from None
    finally:
        s.close()
    return True


def _dtach() -> str:
    path = shutil.which("dtach")
    if path is None:
        raise SessionError("dtach is not installed (Debian package: dtach)")
    return path


def ensure_session(
    sessions: Path,
    agent: str,
    name: str,
    agents: Mapping[str, Sequence[str]] = AGENTS,
    env: Mapping[str, str] | None = None,
) -> Path:
    """Start `agent` under dtach unless that session already runs; return its socket."""
    check_request(agent, name, agents)
    sock = socket_path(sessions, agent, name)
    # One launcher may serve several logins at once: serialize create-if-missing.
    with open(sessions / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_alive(sock):
            return sock
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()  # stale: its master died
        argv = [_dtach(), "-n", str(sock), *DTACH_OPTS, *agents[agent]]
        done = subprocess.run(
            argv, capture_output=True, text=True, env=dict(env) if env is not None else None
        )
        if done.returncode != 0 or not is_alive(sock):
            raise SessionError(
                f"could not start {agent!r}: {done.stderr.strip() or 'dtach exited'}"
            )
    return sock


def attach_argv(sock: Path) -> list[str]:
    return [_dtach(), "-a", str(sock), *DTACH_OPTS]


async def serve_launcher(
    sessions: Path,
    agents: Mapping[str, Sequence[str]] = AGENTS,
    env: Mapping[str, str] | None = None,
) -> asyncio.Server:
    """Listen on `sessions/launcher.sock` (the sandbox side)."""
    path = sessions / LAUNCHER_SOCKET
    with contextlib.suppress(FileNotFoundError):
        path.unlink()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            try:
                req = json.loads(line[:MAX_REQUEST])
                agent, name = str(req["agent"]), str(req["name"])
            except (ValueError, KeyError, TypeError):
                raise SessionError("malformed request") from None
            sock = await asyncio.to_thread(ensure_session, sessions, agent, name, agents, env)
            reply = {"ok": True, "socket": str(sock)}
        except SessionError as exc:
            reply = {"ok": False, "error": str(exc)}
        except TimeoutError:
            reply = {"ok": False, "error": "request timed out"}
        writer.write(json.dumps(reply).encode() + b"\n")
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(handle, path=str(path))
    os.chmod(path, 0o660)
    return server


def request_session(sessions: Path, agent: str, name: str, timeout: float = 30.0) -> Path:
    """The sshd side: ask the launcher for a session; return the socket to attach to."""
    check_request(agent, name)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(sessions / LAUNCHER_SOCKET))
        s.sendall(json.dumps({"agent": agent, "name": name}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n") and len(data) < MAX_REQUEST:
            chunk = s.recv(MAX_REQUEST)
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise SessionError(f"the sandbox's session launcher is not reachable: {exc}") from None
    finally:
        s.close()
    try:
        reply = json.loads(data)
    except ValueError:
        raise SessionError("the session launcher sent a malformed reply") from None
    if reply.get("ok") is not True:
        raise SessionError(str(reply.get("error", "session refused")))
    sock = Path(str(reply["socket"]))
    if sock.parent != sessions or sock != socket_path(sessions, agent, name):
        raise SessionError("the session launcher named an unexpected socket")
    return sock
