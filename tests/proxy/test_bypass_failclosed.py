"""mitmproxy continues a flow when an addon hook raises; Umbra's hooks must deny instead.

The test proxy runs with `--test-faults`: a hook raises when the connect target is named
`fault-<hook>.test`. Each test proves the exception denied rather than forwarded.
"""

from __future__ import annotations

import pytest

from tests.proxy.conftest import Env
from tests.proxy.harness import connect_tunnel, read_response, status_of


@pytest.mark.parametrize("hook", ["requestheaders", "request"])
def test_exception_before_forwarding_denies(env: Env, hook: str) -> None:
    mark = env.proxy.log.mark()
    host = f"fault-{hook}.test"
    sock, _ = connect_tunnel(env.proxy, f"{host}:{env.origin.port}", sni=host)
    sock.sendall(f"GET /fault-{hook} HTTP/1.1\r\nHost: {host}:{env.origin.port}\r\n\r\n".encode())
    response = read_response(sock)
    assert status_of(response) == 500
    assert not env.recorder.contains(f"/fault-{hook}".encode())
    record = env.proxy.log.wait_for(mark, lambda r: r["reason"] == "internal_error")
    assert hook in record["detail"]


@pytest.mark.parametrize("hook", ["responseheaders", "response"])
def test_exception_on_response_withholds_it(env: Env, hook: str) -> None:
    """fault-response.test has an injection, so its response is buffered for the reflection check
    and the failing `response` hook withholds it. (Responses to requests that carried no
    credential are streamed through uninspected by design; `responseheaders` still runs first.)"""
    mark = env.proxy.log.mark()
    host = f"fault-{hook}.test"
    sock, _ = connect_tunnel(env.proxy, f"{host}:{env.origin.port}", sni=host)
    sock.sendall(f"GET /fault-{hook} HTTP/1.1\r\nHost: {host}:{env.origin.port}\r\n\r\n".encode())
    response = read_response(sock)
    assert b"origin ok" not in response
    assert status_of(response) in (0, 502)
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "internal_error")


def test_exception_while_dialling_refuses_the_connection(env: Env) -> None:
    mark = env.proxy.log.mark()
    host = "fault-server_connect.test"
    sock, _ = connect_tunnel(env.proxy, f"{host}:{env.origin.port}", sni=host)
    sock.sendall(f"GET /fault-dial HTTP/1.1\r\nHost: {host}:{env.origin.port}\r\n\r\n".encode())
    assert status_of(read_response(sock)) == 502
    assert not env.recorder.contains(b"/fault-dial")
    assert env.proxy.log.wait_for(mark, lambda r: r["decision"] != "allow")


def test_resolver_exception_refuses_the_connection(env: Env) -> None:
    host = "fault-resolver.test"
    sock, _ = connect_tunnel(env.proxy, f"{host}:{env.origin.port}", sni=host)
    sock.sendall(f"GET /fault-resolver HTTP/1.1\r\nHost: {host}:{env.origin.port}\r\n\r\n".encode())
    assert status_of(read_response(sock)) == 502
    assert not env.recorder.contains(b"/fault-resolver")
