"""`umbra auth login`: device flow by default from the issuer the Console advertises, tokens in a
0600 file (no OS keyring here), silent refresh, a clear message on true expiry, no http://."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.console.helpers import Server, unique
from tests.console.oidc_issuer import LocalIssuer


def umbra(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).parent / "umbra")
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k != "UMBRA_OIDC_ISSUER"}
    return {**base, "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "UMBRA_NO_KEYRING": "1"}


def stored(env: dict[str, str]) -> dict[str, object]:
    path = Path(env["XDG_CONFIG_HOME"]) / "umbra" / "console.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    doc: dict[str, object] = json.loads(path.read_text())
    return doc


def expire(env: dict[str, str]) -> None:
    path = Path(env["XDG_CONFIG_HOME"]) / "umbra" / "console.json"
    doc = json.loads(path.read_text())
    doc["expires_at"] = int(time.time()) - 5
    path.write_text(json.dumps(doc))


def test_device_login_refresh_and_expiry(
    console: Server, issuer: LocalIssuer, env: dict[str, str]
) -> None:
    team = unique("team")
    issuer.device_grant, issuer.device_polls = (unique("dev"), [f"{team}:developer"]), 0
    try:
        done = umbra(env, "auth", "login", console.url)  # no --issuer: the Console says which
    finally:
        issuer.device_grant = None
    assert done.returncode == 0, done.stderr
    assert "enter code WDJB-MJHT" in done.stdout
    doc = stored(env)
    assert isinstance(doc["token"], str) and doc["token"] not in done.stdout + done.stderr
    assert str(doc["refresh_token"]).startswith("rt-") and doc["client_id"] == "umbra-cli"
    # an access token about to expire is renewed silently
    expire(env)
    before = issuer.refreshes
    status = umbra(env, "auth", "status", "--json")
    assert status.returncode == 0, status.stderr
    assert issuer.refreshes == before + 1
    assert int(str(stored(env)["expires_at"])) > time.time() + 60
    # the issuer no longer honours the refresh token: the session has truly expired
    issuer.refresh_tokens.clear()
    expire(env)
    status = umbra(env, "auth", "status")
    assert status.returncode == 2
    assert "run `umbra auth login`" in status.stderr and "Traceback" not in status.stderr
    proxy = subprocess.run(
        [sys.executable, "-m", "umbra.cli.ssh_proxy", "cvm_x"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proxy.returncode == 1
    assert proxy.stderr.strip().endswith(
        "console: your Console session has expired: run `umbra auth login`"
    )


@pytest.mark.parametrize("url", ["http://console.example.com", "http://10.0.0.5:8000", "ftp://x"])
def test_plain_http_is_refused_except_loopback(env: dict[str, str], url: str) -> None:
    done = umbra(env, "auth", "login", url, "--token-file", "/dev/null")
    assert done.returncode == 2
    assert "https://" in done.stderr and "Traceback" not in done.stderr
    assert not (Path(env["XDG_CONFIG_HOME"]) / "umbra" / "console.json").exists()
