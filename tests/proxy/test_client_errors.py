"""A sandbox that breaks its own request is logged as `client_error`, never `upstream_error`:
real malformed requests through the real proxy (`umbra proxy serve`)."""

from __future__ import annotations

import contextlib
import socket

import pytest

from tests.proxy.conftest import Env
from tests.proxy.harness import auth_header, connect_tunnel, read_response


def _plain(env: Env, path: str, framing: bytes, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", env.proxy.port), timeout=10)
    sock.sendall(
        f"POST http://plain.test:{env.plain.port}{path} HTTP/1.1\r\n"
        f"Host: plain.test:{env.plain.port}\r\nProxy-Authorization: {auth_header()}\r\n".encode()
        + framing
        + b"\r\n"
        + body
    )
    return sock


@pytest.mark.parametrize(
    ("name", "framing", "body"),
    [
        # A chunk size that is not hex: the request body cannot be parsed.
        ("bad-chunk", b"Transfer-Encoding: chunked\r\n", b"5\r\nhello\r\nzz\r\nnope\r\n"),
        # Declares 100 bytes, sends 10 and half-closes: the body is cut short by the client.
        ("short-body", b"Content-Length: 100\r\n", b"0123456789"),
    ],
)
def test_malformed_client_request_is_client_error(
    env: Env, name: str, framing: bytes, body: bytes
) -> None:
    mark = env.proxy.log.mark()
    path = f"/client-error-{name}"
    sock = _plain(env, path, framing, body)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    read_response(sock, timeout=5)
    sock.close()
    record = env.proxy.log.wait_for(mark, lambda r: r.get("path") == path)
    assert record["reason"] == "client_error", record
    assert record["decision"] == "deny" and record["status"] == 400
    assert record["cvm_id"] == "cvm-alice"
    assert not env.recorder.contains(path.encode())


def test_malformed_body_inside_tls_is_client_error(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(env.proxy, f"api.test:{env.origin.port}", sni="api.test")
    sock.sendall(
        f"POST /client-error-tls HTTP/1.1\r\nHost: api.test:{env.origin.port}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nxyz\r\n".encode()
    )
    read_response(sock, timeout=5)
    sock.close()
    record = env.proxy.log.wait_for(mark, lambda r: r.get("path") == "/client-error-tls")
    assert record["reason"] == "client_error", record
    assert not env.recorder.contains(b"/client-error-tls")
