"""A real OS keyring for tests: a private D-Bus session bus and gnome-keyring's Secret Service.

`dbus-daemon` runs with a minimal config (no service directories, so nothing is activated
behind our back) on a socket in our own directory; `gnome-keyring-daemon --components=secrets`
joins it, either unlocked (login keyring created from a password on stdin) or locked (no
password: any attempt to store prompts, and with no prompter the prompt is dismissed). Every
process is ours and is ended by pid in `finally`. Names: `u10-kr-<pid>-<n>`.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

_counter = itertools.count()
BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""
SECRETS = "org.freedesktop.secrets"


def require() -> None:
    for tool, package in (("dbus-daemon", "dbus"), ("gnome-keyring-daemon", "gnome-keyring")):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: run scripts/system-deps (apt {package})")


def _owned(address: str, name: str) -> bool:
    from jeepney import DBusAddress, new_method_call
    from jeepney.io.blocking import open_dbus_connection

    bus = DBusAddress("/org/freedesktop/DBus", "org.freedesktop.DBus", "org.freedesktop.DBus")
    try:
        with open_dbus_connection(address) as conn:
            reply = conn.send_and_get_reply(new_method_call(bus, "NameHasOwner", "s", (name,)))
    except OSError:
        return False
    return bool(reply.body[0])


@contextmanager
def secret_service(base: Path, *, unlocked: bool = True) -> Iterator[dict[str, str]]:
    """Yield the environment variables that point a client at this keyring."""
    root = base / f"u10-kr-{os.getpid()}-{next(_counter)}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        (root / "run").mkdir(parents=True, mode=0o700)
        (root / "data").mkdir(mode=0o700)
        socket = root / "bus"
        config = root / "bus.conf"
        config.write_text(BUS_CONFIG.format(socket=socket))
        procs.append(
            subprocess.Popen(
                ["dbus-daemon", f"--config-file={config}", "--nofork", "--nopidfile"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        env = {
            "DBUS_SESSION_BUS_ADDRESS": f"unix:path={socket}",
            "XDG_RUNTIME_DIR": str(root / "run"),
            "XDG_DATA_HOME": str(root / "data"),
        }
        _wait(lambda: socket.exists(), "dbus-daemon did not listen")
        daemon = subprocess.Popen(
            ["gnome-keyring-daemon", "--foreground", "--components=secrets"]
            + (["--unlock"] if unlocked else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **env, "HOME": str(root)},
        )
        procs.append(daemon)
        assert daemon.stdin is not None
        if unlocked:
            daemon.stdin.write(b"u10-test-keyring-password")
        daemon.stdin.close()
        _wait(lambda: _owned(env["DBUS_SESSION_BUS_ADDRESS"], SECRETS), "no Secret Service")
        yield env
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def _wait(ready: object, what: str, timeout: float = 15) -> None:
    assert callable(ready)
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(what)
        time.sleep(0.05)
