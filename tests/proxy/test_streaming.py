"""Responses stream through the proxy, also for requests that carried an injected credential: the
reflection guard checks them chunk by chunk (real origin, real `umbra proxy serve`)."""

from __future__ import annotations

import time

from tests.proxy.conftest import Env
from tests.proxy.harness import (
    TEAM_SECRET,
    OriginHandler,
    Seen,
    connect_tunnel,
    curl,
    curl_status,
    read_response,
    status_of,
)


def test_sse_with_injection_arrives_event_by_event(env: Env) -> None:
    """Three events 0.4 s apart: each must arrive before the next is sent (no buffering)."""
    host = f"api.test:{env.origin.port}"
    sock, _ = connect_tunnel(env.proxy, host, sni="api.test")
    sock.sendall(f"GET /sse?n=3 HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    sock.settimeout(10)
    seen: dict[int, float] = {}
    data = b""
    started = time.monotonic()
    while len(seen) < 3:
        chunk = sock.recv(65536)
        assert chunk, f"stream ended early: {data!r}"
        data += chunk
        for index in range(3):
            if index not in seen and f"event-{index}".encode() in data:
                seen[index] = time.monotonic() - started
    sock.close()
    assert seen[1] - seen[0] > 0.2 and seen[2] - seen[1] > 0.2, seen
    assert env.recorder.host_saw("api.test", f"Bearer {TEAM_SECRET}".encode())


def test_authenticated_download_larger_than_max_body_succeeds(env: Env) -> None:
    size = 3 << 20  # the test proxy's --max-body is 1 MiB
    result = curl(env.proxy, f"https://api.test:{env.origin.port}/stream-big?n={size}")
    assert curl_status(result) == 200
    assert len(result.stdout) == size + len("\n200")


def test_reflection_across_a_chunk_boundary_is_cut_before_either_half(env: Env) -> None:
    mark = env.proxy.log.mark()
    result = curl(env.proxy, f"https://api.test:{env.origin.port}/reflect-split")
    assert result.returncode != 0
    half = len(f"Bearer {TEAM_SECRET}") // 2
    assert "you sent" in result.stdout  # what came before the credential was not held back
    assert f"Bearer {TEAM_SECRET}"[:half] not in result.stdout
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "credential_reflected")


def test_reflection_in_a_gzip_body_is_cut(env: Env) -> None:
    mark = env.proxy.log.mark()
    result = curl(env.proxy, f"https://api.test:{env.origin.port}/reflect-gzip", "--compressed")
    assert result.returncode != 0
    assert TEAM_SECRET not in result.stdout
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "credential_reflected")


def test_keep_alive_requests_reuse_one_checked_upstream_connection(env: Env) -> None:
    """Requests on one client connection share one upstream connection (a new TCP + TLS handshake
    upstream per request was most of the time to first byte), still dialled to the checked address
    and still with the credential injected into each request."""
    host = f"api.test:{env.origin.port}"

    injected: list[bool] = []

    def peer_port(handler: OriginHandler, seen: Seen) -> None:
        injected.append(f"Bearer {TEAM_SECRET}" in seen.header("authorization"))
        handler.send(200, b"%d" % handler.client_address[1])

    env.origin.routes["api.test"] = peer_port
    try:
        sock, _ = connect_tunnel(env.proxy, host, sni="api.test")
        bodies = []
        for _ in range(3):
            sock.sendall(f"GET /peer HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            response = read_response(sock)
            assert status_of(response) == 200, response
            bodies.append(response.partition(b"\r\n\r\n")[2])
        sock.close()
    finally:
        del env.origin.routes["api.test"]
    assert len(set(bodies)) == 1, bodies  # same upstream source port every time
    assert injected == [True, True, True]


def test_a_response_ending_in_part_of_the_credential_arrives_whole(env: Env) -> None:
    """The reflection guard holds back a tail that could start the credential; at the end of the
    body that tail is passed on (it once was dropped, and a Content-Length client waited for it)."""
    host = f"api.test:{env.origin.port}"
    body = b"the header starts with " + f"Bearer {TEAM_SECRET}"[:12].encode()
    env.origin.routes["api.test"] = lambda handler, _seen: handler.send(200, body)
    try:
        sock, _ = connect_tunnel(env.proxy, host, sni="api.test")
        with sock:
            sock.sendall(f"GET /tail HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            response = read_response(sock, timeout=5)
    finally:
        del env.origin.routes["api.test"]
    assert response.partition(b"\r\n\r\n")[2] == body
