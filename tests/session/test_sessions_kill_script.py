"""The `umbra sessions kill` script on its own, with real dtach: which sockets it picks, that it
ends the agent and the master, and the stale and ambiguous cases (the end-to-end path over
attested SSH is `test_session.py::test_sessions_kill_ends_the_agent_and_the_name_can_start_again`)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from umbra.cli.sessions import KILL_SESSION
from umbra.sandbox.sessions import DTACH_OPTS, is_alive


@pytest.fixture
def sessions(tmp_path: Path) -> Path:
    if shutil.which("dtach") is None:
        pytest.fail("dtach is missing: run scripts/system-deps (apt dtach)")
    return tmp_path


def _default_hup() -> None:
    """The agent as a CVM's sandbox runs it, whatever ran the tests: a SIGHUP ignored by an
    ancestor (`nohup`) is inherited across exec, and the agent then outlives its master's hangup."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _start(sessions: Path, socket_name: str) -> int:
    agent = sessions / f"{socket_name}.sh"
    pid_file = sessions / f"{socket_name}.pid"
    agent.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 300\n")
    agent.chmod(0o755)
    subprocess.run(
        ["dtach", "-n", str(sessions / socket_name), *DTACH_OPTS, str(agent)],
        check=True, preexec_fn=_default_hup,
    )  # fmt: skip
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text().strip():
            return int(pid_file.read_text())
        time.sleep(0.05)
    raise AssertionError("the agent did not start")


def _kill(sessions: Path, *candidates: str) -> list[str]:
    done = subprocess.run(
        ["sh", "-c", KILL_SESSION, "umbra-kill", *candidates],
        capture_output=True, text=True, env={**os.environ, "UMBRA_SESSIONS": str(sessions)},
        timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_kill_ends_agent_and_master_and_leaves_the_other_agent(sessions: Path) -> None:
    claude = _start(sessions, "claude-x.dtach")
    shell = _start(sessions, "shell-x.dtach")
    every = ("claude-x.dtach", "codex-x.dtach", "shell-x.dtach")
    assert _kill(sessions, *every) == ["match", "claude-x.dtach", "match", "shell-x.dtach"]
    assert not _gone(claude) and not _gone(shell)  # ambiguous: nothing was touched
    out = _kill(sessions, "claude-x.dtach")
    assert out[:2] == ["killed", "claude-x.dtach"]
    deadline = time.monotonic() + 30  # generous: a loaded CI machine (it once took over 5 s)
    while not _gone(claude) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(claude)
    assert not (sessions / "claude-x.dtach").exists()
    assert is_alive(sessions / "shell-x.dtach") and not _gone(shell)
    assert _kill(sessions, "claude-x.dtach") == []  # nothing left by that name
    assert _kill(sessions, "shell-x.dtach")[0] == "killed"


def test_a_socket_no_process_holds_is_removed_as_stale(sessions: Path) -> None:
    import socket

    stale = sessions / "codex-y.dtach"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # a socket file whose master is gone
    assert _kill(sessions, "codex-y.dtach") == ["stale", "codex-y.dtach"]
    assert not stale.exists()
