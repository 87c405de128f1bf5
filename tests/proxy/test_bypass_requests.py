"""Bypass techniques in the request itself: path tricks, methods, smuggling framings, h2c."""

from __future__ import annotations

import contextlib
import socket

import pytest

from tests.proxy.conftest import Env
from tests.proxy.harness import auth_header, connect_tunnel, read_response, status_of


def _send(env: Env, host: str, raw: bytes) -> bytes:
    sock, _ = connect_tunnel(env.proxy, f"{host}:{env.origin.port}", sni=host)
    sock.sendall(raw)
    return read_response(sock)


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/public/../admin/users", "rule_deny"),  # dot segments are removed before matching
        ("/public/%2e%2e/admin/users", "invalid_path"),  # encoded dot segment
        ("/public%2f..%2fadmin/users", "invalid_path"),  # encoded slash
        ("/public/%252e%252e/admin", "invalid_path"),  # double encoding
        ("/public/..;/admin/users", "invalid_path"),  # servlet path parameter
        ("/public//admin", "invalid_path"),  # empty segment
        ("/%61dmin/users", "rule_deny"),  # %61 is 'a': encoded unreserved characters decode
    ],
)
def test_path_tricks_cannot_reach_denied_paths(env: Env, path: str, reason: str) -> None:
    mark = env.proxy.log.mark()
    raw = f"GET {path} HTTP/1.1\r\nHost: api.test:{env.origin.port}\r\n\r\n".encode()
    assert status_of(_send(env, "api.test", raw)) in (400, 403)
    assert not any("admin" in seen.path for seen in env.recorder.snapshot())
    env.proxy.log.wait_for(mark, lambda r: r["decision"] == "deny" and r["reason"] == reason)


def test_method_not_allowed_on_read_only_host(env: Env) -> None:
    mark = env.proxy.log.mark()
    raw = f"POST /ro-post HTTP/1.1\r\nHost: ro.test:{env.origin.port}\r\nContent-Length: 2\r\n\r\nhi".encode()
    assert status_of(_send(env, "ro.test", raw)) == 403
    assert not env.recorder.contains(b"/ro-post")
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "no_matching_rule")


@pytest.mark.parametrize("method", ["TRACE", "PROPFIND", "CONNECT"])
def test_unsupported_methods(env: Env, method: str) -> None:
    mark = env.proxy.log.mark()
    target = f"api.test:{env.origin.port}" if method == "CONNECT" else "/odd-method"
    raw = f"{method} {target} HTTP/1.1\r\nHost: api.test:{env.origin.port}\r\n\r\n".encode()
    assert status_of(_send(env, "api.test", raw)) in (400, 405)
    assert not env.recorder.contains(b"/odd-method")
    env.proxy.log.wait_for(
        mark, lambda r: r["decision"] == "deny" or r["reason"] == "invalid_request"
    )


@pytest.mark.parametrize(
    "framing",
    [
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: xchunked\r\n",
        b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
        b"Content-Length: 4\r\nContent-Length: 40\r\n",
        b"Transfer-Encoding : chunked\r\n",
    ],
)
def test_smuggling_framings_are_refused(env: Env, framing: bytes) -> None:
    smuggled = b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: api.test\r\n\r\n"
    raw = (
        f"POST /front HTTP/1.1\r\nHost: api.test:{env.origin.port}\r\n".encode()
        + framing
        + b"\r\n"
        + smuggled
    )
    response = _send(env, "api.test", raw)
    assert status_of(response) in (0, 400)
    assert not env.recorder.contains(b"/smuggled")
    assert not env.recorder.contains(b"/front")


def test_h2c_upgrade_is_not_honoured(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock = socket.create_connection(("127.0.0.1", env.proxy.port), timeout=10)
    sock.sendall(
        f"GET http://plain.test:{env.plain.port}/h2c HTTP/1.1\r\nHost: plain.test:{env.plain.port}\r\n"
        f"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n"
        f"Proxy-Authorization: {auth_header()}\r\n\r\n".encode()
    )
    response = read_response(sock)
    assert status_of(response) != 101
    for seen in env.recorder.snapshot():
        if seen.path == "/h2c":
            assert not seen.header("upgrade") and not seen.header("http2-settings")
    env.proxy.log.wait_for(mark, lambda r: True)


def test_websocket_upgrade_to_other_protocol_refused(env: Env) -> None:
    mark = env.proxy.log.mark()
    raw = (
        f"GET /upgrade-tls HTTP/1.1\r\nHost: api.test:{env.origin.port}\r\n"
        "Connection: Upgrade\r\nUpgrade: TLS/1.2\r\n\r\n"
    ).encode()
    assert status_of(_send(env, "api.test", raw)) == 400
    assert not env.recorder.contains(b"/upgrade-tls")
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "upgrade_refused")


def test_oversized_body_by_content_length(env: Env) -> None:
    mark = env.proxy.log.mark()
    body = b"a" * (2 << 20)
    head = f"POST /too-big HTTP/1.1\r\nHost: api.test:{env.origin.port}\r\nContent-Length: {len(body)}\r\n\r\n"
    sock, _ = connect_tunnel(env.proxy, f"api.test:{env.origin.port}", sni="api.test")
    # The declared length is refused from the headers alone, before any body byte is sent (had
    # the body been sent first, the proxy's close could reset the connection before the 413 is
    # read: a race of the test, not of the proxy).
    sock.sendall(head.encode())
    assert status_of(read_response(sock)) == 413
    with contextlib.suppress(OSError):
        sock.sendall(body)
    sock.close()
    assert not env.recorder.contains(b"/too-big")
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "body_too_large" and r["status"] == 413)


def test_oversized_chunked_body_is_never_streamed(env: Env) -> None:
    mark = env.proxy.log.mark()
    chunk = b"b" * 65536
    body = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(40)) + b"0\r\n\r\n"
    raw = (
        f"POST /too-big-chunked HTTP/1.1\r\nHost: api.test:{env.origin.port}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        + body
    )
    sock, _ = connect_tunnel(env.proxy, f"api.test:{env.origin.port}", sni="api.test")
    with contextlib.suppress(OSError):
        sock.sendall(raw)
    assert status_of(read_response(sock)) in (0, 413)
    assert not env.recorder.contains(b"/too-big-chunked")
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "body_too_large")
