"""Keep-alive through the real proxy: requests on one client connection reuse one upstream
connection, as with stock mitmproxy. The dial guard dials the checked IP literal; without reuse
every request dialled anew and left the previous upstream connection open (a loopback origin with
a small accept backlog then stalled every fifth request until its idle timeout)."""

from __future__ import annotations

import time

from tests.proxy.conftest import Env
from tests.proxy.harness import connect_tunnel, read_response, status_of


def test_requests_on_one_connection_reuse_one_upstream_connection(env: Env) -> None:
    target = f"other.test:{env.origin.port}"
    sock, _ = connect_tunnel(env.proxy, target, sni="other.test")
    before = env.origin.connections
    started = time.monotonic()
    with sock:
        for index in range(8):
            sock.sendall(f"GET /keepalive-{index} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            assert status_of(read_response(sock, timeout=5)) == 200
    assert env.origin.connections - before == 1
    assert time.monotonic() - started < 5, "a request on the kept-alive connection stalled"
    for index in range(8):
        assert env.recorder.contains(f"/keepalive-{index}".encode())
