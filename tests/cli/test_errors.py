"""The CLI's one error style (cli/output.fail): `error: MESSAGE` and, when there is one,
`fix: WHAT TO DO` on stderr with nothing on stdout; with --json one object on stdout,
`{"ok": false, "error": ..., "fix": ...}`. Several commands' errors, both ways."""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from umbra.cli.app import app


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # not logged in
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "300")
    return CliRunner()


@pytest.fixture
def held(tmp_path: Path) -> Iterator[Path]:
    """A state directory whose `umbra up` lock another run holds."""
    state = tmp_path / "state"
    state.mkdir()
    with (state / "up.lock").open("a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        handle.write("4242")
        handle.flush()
        yield state


def _text(runner: CliRunner, *args: str, code: int) -> list[str]:
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, (args, result.output)
    assert result.stdout == "", (args, result.stdout)
    lines = result.stderr.splitlines()
    assert lines and lines[0].startswith("error: "), (args, result.stderr)
    assert "Traceback" not in result.stderr
    return lines


def _json(runner: CliRunner, *args: str, code: int) -> dict[str, object]:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == code, (args, result.output)
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and set(doc) <= {"ok", "error", "fix"}, doc
    return dict(doc)


@pytest.mark.parametrize("command", ["up", "down"])
def test_umbra_up_and_down_errors_go_to_stderr_with_their_fix(
    runner: CliRunner, held: Path, command: str
) -> None:
    # Fails on the old code: `umbra up: …` and `fix: …` were printed on stdout.
    lines = _text(runner, command, "--state-dir", str(held), code=1)
    assert lines == [
        f"error: another `umbra up` or `umbra down` is running on {held} (pid 4242)",
        "fix: wait for it to finish, or stop it",
    ]
    doc = _json(runner, command, "--state-dir", str(held), code=1)
    assert doc == {
        "ok": False,
        "error": f"another `umbra up` or `umbra down` is running on {held} (pid 4242)",
        "fix": "wait for it to finish, or stop it",
    }


def test_not_logged_in(runner: CliRunner) -> None:
    (line,) = _text(runner, "cvm", "list", code=2)
    assert line == "error: not logged in: run `umbra auth login URL`"
    assert _json(runner, "cvm", "list", code=2) == {
        "ok": False,
        "error": "not logged in: run `umbra auth login URL`",
    }


def test_attest_bad_time(runner: CliRunner) -> None:
    (line,) = _text(runner, "attest", "simulate", "out", "--at", "-1", code=2)
    assert line == "error: --at must be a Unix time (seconds, >= 0), not -1"
    assert _json(runner, "attest", "simulate", "out", "--at", "-1", code=2)["error"] == (
        "--at must be a Unix time (seconds, >= 0), not -1"
    )


def test_proxy_serve_bad_options(runner: CliRunner) -> None:
    # Fails on the old code: `umbra proxy serve: …`, its own style.
    (line,) = _text(runner, "proxy", "serve", "--policy-dir", "p", "--console-ca", "c", code=2)
    assert line.startswith("error: ") and "--console-ca needs --console" in line


def test_console_configuration(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    # Fails on the old code: `configuration error: …`, its own style.
    monkeypatch.setenv("UMBRA_CONSOLE_DATABSE_URL", "sqlite://")
    (line,) = _text(runner, "console", "audit-verify", code=2)
    assert line == (
        "error: the Console's configuration: UMBRA_CONSOLE_DATABSE_URL: not a Console setting; "
        "did you mean UMBRA_CONSOLE_DATABASE_URL?"
    )
