"""`umbra cvm launch` without --ssh-key (issue #27): ssh's default key if there is one, else an
ed25519 key umbra makes once (0600) and the session commands offer. Real CLI, real Console."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.console.helpers import Team
from umbra.cli.ssh_config import options

UMBRA = str(Path(sys.executable).parent / "umbra")


def _env(team: Team, tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    config = home / ".config" / "umbra"
    config.mkdir(parents=True)
    token = team.dev.headers["Authorization"].split()[1]
    (config / "console.json").write_text(
        json.dumps({"url": team.server.url, "token": token, "team": team.name})
    )
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "UMBRA_NO_KEYRING": "1",
    }


def _launch(team: Team, env: dict[str, str], name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [UMBRA, "cvm", "launch", name, "--security-cvm", team.scvm_id, "--json"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip


def test_first_launch_creates_a_key_then_reuses_it(
    team: Team, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _env(team, tmp_path)
    first = _launch(team, env, "k1")
    assert first.returncode == 0, first.stderr
    key = Path(env["XDG_CONFIG_HOME"]) / "umbra" / "ssh" / "id_ed25519"
    assert first.stderr.strip() == (
        f"Created SSH key {key}.pub (no --ssh-key given, none in ~/.ssh)"
    )
    assert key.stat().st_mode & 0o777 == 0o600
    pub = key.with_name("id_ed25519.pub").read_text().split()
    assert json.loads(first.stdout)["ssh_keys"] == [" ".join(pub)]
    second = _launch(team, env, "k2")
    assert second.returncode == 0, second.stderr
    assert second.stderr.strip() == f"Using SSH key {key}.pub (no --ssh-key given)"
    assert json.loads(second.stdout)["ssh_keys"] == [" ".join(pub)]
    # The session commands offer it (and ssh's defaults, once they exist).
    monkeypatch.setenv("HOME", env["HOME"])
    monkeypatch.setenv("XDG_CONFIG_HOME", env["XDG_CONFIG_HOME"])
    monkeypatch.delenv("UMBRA_SSH_IDENTITY", raising=False)
    assert ("IdentityFile", str(key)) in options("cvm_x", reuse=False)


def test_an_existing_ssh_key_is_used(team: Team, tmp_path: Path) -> None:
    env = _env(team, tmp_path)
    ssh = Path(env["HOME"]) / ".ssh"
    ssh.mkdir()
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / "id_ed25519")], check=True
    )
    done = _launch(team, env, "k3")
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == f"Using SSH key {ssh}/id_ed25519.pub (no --ssh-key given)"
    pub = (ssh / "id_ed25519.pub").read_text().split()
    assert json.loads(done.stdout)["ssh_keys"] == [" ".join(pub)]
    assert not (Path(env["XDG_CONFIG_HOME"]) / "umbra" / "ssh" / "id_ed25519").exists()
