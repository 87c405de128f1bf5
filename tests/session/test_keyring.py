"""`umbra auth login` with a real OS keyring (gnome-keyring's Secret Service on a private D-Bus
session bus): tokens land in the keyring and not in the file; a refresh updates the entry; logout
removes it; a locked keyring or none at all means the 0600 file, said in one clear line; the
token bytes appear in no output and in no file."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.console.helpers import Server, unique
from tests.console.oidc_issuer import LocalIssuer
from tests.session import secret_service
from umbra.cli.credentials import KEYRING_SERVICE


def umbra(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).parent / "umbra")
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture
def base_env(tmp_path: Path) -> dict[str, str]:
    drop = {"UMBRA_OIDC_ISSUER", "UMBRA_NO_KEYRING", "DBUS_SESSION_BUS_ADDRESS"}
    base = {k: v for k, v in os.environ.items() if k not in drop}
    (tmp_path / "run").mkdir(mode=0o700)
    return {
        **base,
        "XDG_CONFIG_HOME": str(tmp_path / "cfg"),
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
    }


@pytest.fixture
def keyring_env(base_env: dict[str, str], tmp_path: Path) -> Iterator[dict[str, str]]:
    secret_service.require()
    with secret_service.secret_service(tmp_path) as env:
        yield {**base_env, **env}


def stored_file(env: dict[str, str]) -> tuple[dict[str, object], bytes]:
    path = Path(env["XDG_CONFIG_HOME"]) / "umbra" / "console.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    raw = path.read_bytes()
    doc: dict[str, object] = json.loads(raw)
    return doc, raw


def in_keyring(env: dict[str, str], url: str) -> dict[str, str] | None:
    """Read the entry with keyring's Secret Service backend, in a process on that bus."""
    done = subprocess.run(
        [sys.executable, "-c",
         "import sys; from keyring.backends.SecretService import Keyring; "
         "v = Keyring().get_password(sys.argv[1], sys.argv[2]); print(v or '')",
         KEYRING_SERVICE, url],
        capture_output=True, text=True, env=env, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = done.stdout.strip()
    return json.loads(text) if text else None


def device_login(
    env: dict[str, str], console: Server, issuer: LocalIssuer
) -> subprocess.CompletedProcess[str]:
    team = unique("team")
    issuer.device_grant, issuer.device_polls = (unique("dev"), [f"{team}:developer"]), 0
    try:
        return umbra(env, "auth", "login", console.url)
    finally:
        issuer.device_grant = None


def expire(env: dict[str, str]) -> None:
    path = Path(env["XDG_CONFIG_HOME"]) / "umbra" / "console.json"
    doc = json.loads(path.read_text())
    doc["expires_at"] = int(time.time()) - 5
    path.write_text(json.dumps(doc))


def test_tokens_live_in_the_keyring_refresh_updates_it_logout_removes_it(
    console: Server, issuer: LocalIssuer, keyring_env: dict[str, str]
) -> None:
    env = keyring_env
    done = device_login(env, console, issuer)
    assert done.returncode == 0, done.stderr
    assert "tokens stored in the OS keyring (keyring.backends.SecretService.Keyring)" in done.stdout
    doc, raw = stored_file(env)
    assert doc["keyring"] is True and doc["token"] == "" and doc["refresh_token"] is None
    entry = in_keyring(env, console.url)
    assert entry is not None
    token, refresh = entry["token"], entry["refresh_token"]
    assert token and refresh.startswith("rt-")
    outputs = [done.stdout + done.stderr]
    assert token.encode() not in raw and refresh.encode() not in raw

    # the ProxyCommand reads the keyring too: the Console accepts the token (no 401), then
    # answers for the unknown CVM
    proxy = subprocess.run(
        [sys.executable, "-m", "umbra.cli.ssh_proxy", "cvm_nope"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proxy.returncode == 1 and "refused cvm_nope: console: " in proxy.stderr
    assert "umbra auth login" not in proxy.stderr and "keyring" not in proxy.stderr
    outputs.append(proxy.stdout + proxy.stderr)
    # ... and does so without importing `keyring` (its import alone costs ~0.2-0.3 s)
    probe = subprocess.run(
        [sys.executable, "-c",
         "import sys, umbra.cli.ssh_proxy; from umbra.cli.credentials import fresh_login; "
         "assert fresh_login().token; print('keyring' in sys.modules)"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert probe.stdout.strip() == "False", probe.stderr

    # a refresh stores the new tokens in the keyring entry, still nothing in the file
    expire(env)
    before = issuer.refreshes
    status = umbra(env, "auth", "status", "--json")
    assert status.returncode == 0, status.stderr
    assert issuer.refreshes == before + 1
    outputs.append(status.stdout + status.stderr)
    renewed = in_keyring(env, console.url)
    assert renewed is not None and renewed["token"] != token
    doc, raw = stored_file(env)
    assert doc["token"] == "" and renewed["token"].encode() not in raw
    assert int(str(doc["expires_at"])) > time.time() + 60

    # the keyring's own files on disk are encrypted: no token bytes there either
    for path in Path(env["XDG_DATA_HOME"]).rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert token.encode() not in data and renewed["token"].encode() not in data

    out = umbra(env, "auth", "logout")
    assert out.returncode == 0, out.stderr
    outputs.append(out.stdout + out.stderr)
    assert in_keyring(env, console.url) is None
    assert not (Path(env["XDG_CONFIG_HOME"]) / "umbra" / "console.json").exists()
    for text in outputs:
        for secret in (token, refresh, renewed["token"], renewed["refresh_token"]):
            assert secret not in text


@pytest.mark.parametrize("keyring", ["locked", "none"])
def test_without_a_usable_keyring_the_file_holds_the_tokens_and_says_so(
    console: Server,
    issuer: LocalIssuer,
    base_env: dict[str, str],
    tmp_path: Path,
    keyring: str,
) -> None:
    if keyring == "locked":
        secret_service.require()
        ctx = secret_service.secret_service(tmp_path, unlocked=False)
    else:
        from contextlib import nullcontext

        ctx = nullcontext({})  # no session bus at all
    with ctx as extra:
        env = {**base_env, **extra}
        done = device_login(env, console, issuer)
        assert done.returncode == 0, done.stderr
        doc, _ = stored_file(env)
        path = Path(env["XDG_CONFIG_HOME"]) / "umbra" / "console.json"
        line = next(x for x in done.stdout.splitlines() if x.startswith("no usable OS keyring"))
        assert line.endswith(f"tokens stored in {path} (mode 0600)"), line
        why = "the keyring refused to store" if keyring == "locked" else "no keyring backend"
        assert why in line
        assert doc["keyring"] is False and isinstance(doc["token"], str) and doc["token"]
        assert str(doc["token"]) not in done.stdout + done.stderr
        assert str(doc["refresh_token"]) not in done.stdout + done.stderr
        status = umbra(env, "auth", "status")
        assert status.returncode == 0, status.stderr


def test_a_keyring_that_went_away_says_so_in_one_line(
    console: Server, issuer: LocalIssuer, base_env: dict[str, str], tmp_path: Path
) -> None:
    secret_service.require()
    with secret_service.secret_service(tmp_path) as extra:
        env = {**base_env, **extra}
        assert device_login(env, console, issuer).returncode == 0
    # the session bus and the keyring daemon are gone (logged out of the desktop, say)
    status = umbra(env, "auth", "status")
    assert status.returncode == 2
    assert "the OS keyring cannot be read: unlock it or run `umbra auth login URL`" in (
        status.stderr
    )
    assert "Traceback" not in status.stderr + status.stdout
    proxy = subprocess.run(
        [sys.executable, "-m", "umbra.cli.ssh_proxy", "cvm_x"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proxy.returncode == 1 and proxy.stdout == ""
    assert proxy.stderr.startswith("umbra ssh-proxy: refused cvm_x: console: the OS keyring")
