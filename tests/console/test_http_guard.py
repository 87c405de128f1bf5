"""The Console's HTTP/1.1 protocol: a slow header section is cut off, a huge one gets 431."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI

from umbra.console.http_guard import GuardedH11Protocol
from umbra.console.serve import listening_socket


class QuickDeadline(GuardedH11Protocol):
    header_read_timeout = 0.5


@pytest.fixture
def port() -> Iterator[int]:
    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    sock = listening_socket("127.0.0.1", 0)
    config = uvicorn.Config(
        app, http=QuickDeadline, h11_max_incomplete_event_size=32 << 10, log_config=None
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield int(sock.getsockname()[1])
    server.should_exit = True
    thread.join(timeout=10)


def _exchange(port: int, payload: bytes, wait: float = 0.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(payload)
        time.sleep(wait)
        chunks = []
        while True:
            try:
                chunk = conn.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def test_slow_header_section_is_closed(port: int) -> None:
    # Headers never finish: the server closes the connection (recv returns EOF) on its own.
    started = time.monotonic()
    assert _exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ") == b""
    assert time.monotonic() - started < 4  # closed by the deadline, not the client's timeout
    # A complete request on a fresh connection is served as usual.
    answer = _exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200")


def test_huge_header_section_is_431(port: int) -> None:
    huge = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 10) + b"\r\n\r\n"
    assert _exchange(port, huge).startswith(b"HTTP/1.1 431")
