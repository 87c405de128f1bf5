"""Sessions under real dtach: a dropped attach leaves the agent running; reattaching reaches the
same process. The launcher/helper split is exercised over its real Unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import select
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from umbra.sandbox.sessions import (
    SessionError,
    attach_argv,
    ensure_session,
    is_alive,
    parse_request,
    request_session,
    serve_launcher,
)

pytestmark = pytest.mark.skipif(
    shutil.which("dtach") is None, reason="needs dtach (Debian package dtach; scripts/system-deps)"
)

# A stand-in agent: answers each line with its own PID, so a reattach shows the same process.
AGENT = ("sh", "-c", 'echo "agent $$ ready"; while read -r l; do echo "pid=$$ got=$l"; done')
AGENTS = {"shell": AGENT, "claude": AGENT}


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[Path]:
    d = Path(f"/tmp/umbra-t-{os.getpid()}-sessions")  # short: Unix socket paths max 108 bytes
    d.mkdir(exist_ok=True)
    yield d
    # End each dtach master we started (its command line names our socket directory); the
    # agent is its child and goes with its pty.
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"dtach") and any(str(d).encode() in a for a in argv):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGTERM)
    shutil.rmtree(d, ignore_errors=True)


class Attached:
    """`dtach -a` on a real pseudo-terminal, like sshd's session would run it."""

    def __init__(self, sock: Path) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child
            argv = attach_argv(sock)
            os.execv(argv[0], argv)  # noqa: S606

    def send(self, line: str) -> None:
        os.write(self.fd, line.encode() + b"\r")

    def read_until(self, needle: str, timeout: float = 10) -> str:
        out = b""
        end = time.monotonic() + timeout
        while needle.encode() not in out and time.monotonic() < end:
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    out += os.read(self.fd, 4096)
                except OSError:
                    break
        assert needle.encode() in out, out
        return out.decode(errors="replace")

    def drop(self) -> None:
        """What a dropped SSH connection does to the attach process: SIGHUP, then it is gone."""
        os.close(self.fd)
        os.kill(self.pid, signal.SIGHUP)
        os.waitpid(self.pid, 0)


def _pid(text: str) -> str:
    return text.split("pid=")[-1].split()[0]


def test_dropped_connection_resumes_the_same_process(sessions: Path) -> None:
    sock = ensure_session(sessions, "shell", "main", AGENTS)
    assert is_alive(sock)
    a = Attached(sock)
    a.send("first")
    pid = _pid(a.read_until("got=first"))
    a.drop()
    time.sleep(0.2)
    assert is_alive(sock)  # the agent outlived its connection
    assert ensure_session(sessions, "shell", "main", AGENTS) == sock  # no second agent
    b = Attached(sock)
    b.send("second")
    assert _pid(b.read_until("got=second")) == pid
    b.drop()


def test_stale_socket_is_replaced_with_a_new_agent(sessions: Path) -> None:
    sock = ensure_session(sessions, "shell", "w1", AGENTS)
    a = Attached(sock)
    a.send("x")
    old = _pid(a.read_until("got=x"))
    a.drop()
    os.kill(int(old), signal.SIGKILL)  # the agent dies; dtach's master goes with it
    end = time.monotonic() + 5
    while is_alive(sock) and time.monotonic() < end:
        time.sleep(0.1)
    assert not is_alive(sock)
    sock2 = ensure_session(sessions, "shell", "w1", AGENTS)
    b = Attached(sock2)
    b.send("y")
    assert _pid(b.read_until("got=y")) != old
    b.drop()


async def test_launcher_and_helper_over_the_socket(sessions: Path) -> None:
    server = await serve_launcher(sessions, AGENTS)
    try:
        sock = await asyncio.to_thread(request_session, sessions, "claude", "review")
        assert sock == sessions / "claude-review.dtach" and is_alive(sock)
        again = await asyncio.to_thread(request_session, sessions, "claude", "review")
        assert again == sock
        with pytest.raises(SessionError, match="unknown agent"):
            await asyncio.to_thread(request_session, sessions, "rm -rf /", "x")
        with pytest.raises(SessionError, match="not reachable"):
            await asyncio.to_thread(request_session, sessions / "nowhere", "shell", "x")
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (None, ("shell", "main")),
        ("claude", ("claude", "main")),
        ("codex feature-x", ("codex", "feature-x")),
    ],
)
def test_parse_request(command: str | None, expected: tuple[str, str]) -> None:
    assert parse_request(command) == expected


@pytest.mark.parametrize("command", ["vim", "claude ../../etc", "shell a b", "claude 'a;b'"])
def test_parse_request_refuses(command: str) -> None:
    with pytest.raises(SessionError):
        parse_request(command)
