"""sd_notify(3)'s READY=1 without libsystemd: to a path socket, to an abstract one (`@name`),
nothing without $NOTIFY_SOCKET, and an error (not silence) when the named socket is gone. The
ingress sending it once it listens is checked through the session tests' harness, which starts
`umbra sandbox ingress` as its unit does and waits for the datagram."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from umbra.sandbox.sd_notify import notify_ready


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


def test_ready_goes_to_a_path_socket(tmp_path: Path) -> None:
    path = tmp_path / "n.sock"
    with _receiver(str(path)) as sock:
        assert notify_ready({"NOTIFY_SOCKET": str(path)}) is True
        assert sock.recv(64) == b"READY=1"


def test_ready_goes_to_an_abstract_socket() -> None:
    name = f"umbra-sd-notify-test-{os.getpid()}"
    with _receiver("\0" + name) as sock:
        assert notify_ready({"NOTIFY_SOCKET": "@" + name}) is True
        assert sock.recv(64) == b"READY=1"


def test_without_a_notify_socket_nothing_is_sent() -> None:
    assert notify_ready({}) is False


def test_a_named_socket_that_is_gone_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        notify_ready({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
