"""The daily user's commands through the real `umbra` executable (issue #27): `umbra version`,
`umbra config show` (never a token), shell completion, and errors that say what to run."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

UMBRA = str(Path(sys.executable).parent / "umbra")
TOKEN = "tok-" + "5ecret" * 6
REFRESH = "refresh-" + "hidden" * 6


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TMPDIR")}
    return {
        **keep,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "UMBRA_NO_KEYRING": "1",  # tokens in the 0600 file: the output must still not show them
        "COLUMNS": "200",
    }


def umbra(env: dict[str, str], *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [UMBRA, *args], capture_output=True, text=True, env={**env, **extra}, timeout=60
    )


def _login(env: dict[str, str], url: str, *, local: bool = False) -> None:
    config = Path(env["XDG_CONFIG_HOME"]) / "umbra"
    config.mkdir(parents=True, mode=0o700)
    (config / "console.json").write_text(
        json.dumps({"url": url, "token": TOKEN, "team": "acme", "refresh_token": REFRESH})
    )
    if local:  # what `umbra up` writes for the Console it started
        (config / "embedded.json").write_text(
            json.dumps({"console_url": url, "simulated_pki": "/tmp/pki", "ssh_identity": "/tmp/id"})
        )


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing answers


def test_version(env: dict[str, str]) -> None:
    done = umbra(env, "version", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["umbra"] == metadata.version("umbra")
    assert info["python"] == platform.python_version()
    plain = umbra(env, "version")
    assert plain.stdout.startswith(f"umbra {metadata.version('umbra')} (Python ")


def test_config_show_names_the_console_and_never_a_token(env: dict[str, str]) -> None:
    missing = umbra(env, "config", "show", "--json")
    assert missing.returncode == 0, missing.stderr
    assert json.loads(missing.stdout)["hint"] == "run `umbra auth login URL`"
    _login(env, "https://console.example.com")
    for args in (("config", "show", "--json"), ("config", "show")):
        done = umbra(env, *args, UMBRA_SSH_IDENTITY="/keys/id_ed25519")
        assert done.returncode == 0, done.stderr
        assert TOKEN not in done.stdout + done.stderr
        assert REFRESH not in done.stdout + done.stderr
        assert "5ecret" not in done.stdout and "hidden" not in done.stdout
    info = json.loads(umbra(env, "config", "show", "--json").stdout)
    assert info["console_url"] == "https://console.example.com"
    assert info["team"] == "acme" and info["logged_in"] is True
    assert info["tokens"].endswith("console.json (0600)")
    assert info["config_dir"] == env["XDG_CONFIG_HOME"] + "/umbra"
    assert info["ssh_identity_source"] == "ssh's default keys"


def test_not_logged_in_says_what_to_run(env: dict[str, str]) -> None:
    done = umbra(env, "cvm", "list")
    assert done.returncode == 2
    assert "run `umbra auth login URL`" in done.stderr


def test_local_console_down_says_run_umbra_up(env: dict[str, str]) -> None:
    # Fails on the old code: "cannot reach the Console (ConnectError)", nothing to run.
    url = _dead_url()
    _login(env, url, local=True)
    done = umbra(env, "cvm", "list")
    assert done.returncode == 2
    assert f"the local Console does not answer at {url}; run `umbra up`" in done.stderr
    assert TOKEN not in done.stdout + done.stderr
    info = json.loads(umbra(env, "config", "show", "--json").stdout)
    assert info["local_console"] is True and info["ssh_identity"] == "/tmp/id"


def test_remote_console_down_names_it(env: dict[str, str]) -> None:
    url = _dead_url()
    _login(env, url)
    done = umbra(env, "cvm", "list", "--json")
    assert done.returncode == 2
    error = json.loads(done.stdout)["error"]
    assert error.startswith(f"cannot reach the Console at {url} (ConnectError)")
    assert "umbra auth login URL" in error


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        ("umbra ver", {"version"}),
        ("umbra sessions ", {"kill", "list"}),
        ("umbra config ", {"show"}),
    ],
)
def test_bash_completion_reaches_lazy_commands(
    env: dict[str, str], words: str, expected: set[str]
) -> None:
    done = umbra(
        env,
        _UMBRA_COMPLETE="complete_bash",
        COMP_WORDS=words,
        COMP_CWORD=str(len(words.split(" ")) - 1),
    )
    assert done.returncode == 0, done.stderr
    assert expected <= set(done.stdout.split()), done.stdout


def test_completion_scripts_for_each_shell(env: dict[str, str]) -> None:
    for shell in ("bash", "zsh", "fish"):
        done = umbra(env, "--show-completion", shell)
        assert done.returncode == 0, done.stderr
        assert "_UMBRA_COMPLETE" in done.stdout


def test_config_show_with_a_broken_login_file_says_what_to_run(env: dict[str, str]) -> None:
    config = Path(env["XDG_CONFIG_HOME"]) / "umbra"
    config.mkdir(parents=True)
    (config / "console.json").write_text('{"url": "https://c.example", "token": "' + TOKEN)
    done = umbra(env, "config", "show", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["logged_in"] is False
    assert info["hint"].endswith(
        "is unreadable (ValidationError): run `umbra auth login URL` again"
    )
    assert TOKEN not in done.stdout + done.stderr
