"""Idle auto-stop's activity signal with real dtach sessions and real TCP connections: a running
agent session keeps the Dev CVM up even with nobody logged in; a dead one does not."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from umbra.components.idle_stop import (
    IdleConfig,
    check,
    decide,
    established_on,
    live_sessions,
    main,
    render_units,
)


def _wait_for(path: Path) -> None:
    for _ in range(100):
        if path.exists():
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


@pytest.mark.skipif(shutil.which("dtach") is None, reason="LOUD SKIP: dtach is not installed")
def test_running_agent_sessions_count_and_dead_ones_do_not(tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    (sessions / "notes.txt").write_text("not a socket")
    sock = sessions / "agent-1.sock"
    proc = subprocess.Popen(["dtach", "-N", str(sock), "sleep", "60"])
    try:
        _wait_for(sock)
        assert live_sessions(sessions) == 1
        cfg = IdleConfig(
            sessions_dir=str(sessions), tcp_tables=(), state_file=str(tmp_path / "idle")
        )
        # Hours of no SSH, but an agent is working: never stop.
        assert check(cfg, now=1_000_000.0) == (False, {"sessions": 1, "ssh": 0})
    finally:
        proc.kill()
        proc.wait()
    assert sock.exists() and live_sessions(sessions) == 0


def test_ssh_connections_are_counted_from_the_tcp_table(tmp_path: Path) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    try:
        assert established_on(port, [Path("/proc/net/tcp")]) == 1
    finally:
        for s in (client, conn, server):
            s.close()
    assert established_on(port, [tmp_path / "missing"]) == 0


def test_the_clock_starts_on_idleness_and_resets_on_activity(tmp_path: Path) -> None:
    assert decide(100.0, True, 50.0, 60) == (False, None)
    assert decide(100.0, False, None, 60) == (False, 100.0)
    assert decide(100.0 + 3599, False, 100.0, 60) == (False, 100.0)
    assert decide(100.0 + 3600, False, 100.0, 60) == (True, 100.0)
    cfg = IdleConfig(
        sessions_dir=str(tmp_path / "none"), tcp_tables=(), state_file=str(tmp_path / "s" / "idle")
    )
    assert check(cfg, now=0.0) == (False, {"sessions": 0, "ssh": 0})
    assert check(cfg, now=3600.0)[0] is True
    with pytest.raises(ValueError, match="at least 5"):
        IdleConfig(idle_minutes=1)


def test_the_cli_reports_and_refuses_bad_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "idle.json"
    cfg.write_text(
        json.dumps(
            {"sessions_dir": str(tmp_path), "tcp_tables": [], "state_file": str(tmp_path / "st")}
        )
    )
    assert main(["--config", str(cfg), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out) == {"stop": False, "sessions": 0, "ssh": 0}
    cfg.write_text(json.dumps({"idle_minuts": 3}))
    assert main(["--config", str(cfg), "--dry-run"]) == 2
    assert "idle_minuts" in capsys.readouterr().err
    units = render_units()
    assert "OnUnitActiveSec=5min" in units["umbra-idle.timer"]
    assert "--config /run/umbra/idle.json" in units["umbra-idle.service"]
