"""Bypass techniques against destination naming: the CONNECT target, SNI and Host must agree."""

from __future__ import annotations

import socket
import ssl

import h2.config
import h2.connection
import h2.events

from tests.proxy.conftest import Env
from tests.proxy.harness import (
    TEAM_SECRET,
    auth_header,
    connect_tunnel,
    read_response,
    status_of,
)


def _never_reached(env: Env, marker: str) -> None:
    assert not any(marker in seen.path for seen in env.recorder.snapshot()), (
        "request reached origin"
    )


def _deny_reason(env: Env, mark: int, reason: str) -> None:
    env.proxy.log.wait_for(mark, lambda r: r["decision"] == "deny" and r["reason"] == reason)


def test_sni_disagrees_with_connect_target(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(env.proxy, f"api.test:{env.origin.port}", sni="evil.test")
    sock.sendall(f"GET /sni-mismatch HTTP/1.1\r\nHost: api.test:{env.origin.port}\r\n\r\n".encode())
    assert status_of(read_response(sock)) == 421
    _never_reached(env, "/sni-mismatch")
    _deny_reason(env, mark, "name_mismatch")


def test_host_header_disagrees_with_connect_target(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(env.proxy, f"other.test:{env.origin.port}", sni="other.test")
    # other.test is allowed but has no injection; api.test gets the team credential.
    sock.sendall(b"GET /host-mismatch HTTP/1.1\r\nHost: api.test\r\n\r\n")
    assert status_of(read_response(sock)) == 421
    _never_reached(env, "/host-mismatch")
    _deny_reason(env, mark, "name_mismatch")


def test_host_port_disagrees_with_connect_port(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(env.proxy, f"api.test:{env.origin.port}", sni="api.test")
    sock.sendall(b"GET /port-mismatch HTTP/1.1\r\nHost: api.test:1\r\n\r\n")
    assert status_of(read_response(sock)) == 421
    _never_reached(env, "/port-mismatch")
    _deny_reason(env, mark, "name_mismatch")


def test_second_request_on_connection_switches_host(env: Env) -> None:
    """Agreement is checked on every request, not once per connection."""
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(env.proxy, f"other.test:{env.origin.port}", sni="other.test")
    sock.sendall(f"GET /first HTTP/1.1\r\nHost: other.test:{env.origin.port}\r\n\r\n".encode())
    assert status_of(read_response(sock)) == 200
    sock.sendall(f"GET /switched HTTP/1.1\r\nHost: api.test:{env.origin.port}\r\n\r\n".encode())
    assert status_of(read_response(sock)) == 421
    _never_reached(env, "/switched")
    _deny_reason(env, mark, "name_mismatch")


def test_absolute_form_inside_tunnel_names_other_host(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(env.proxy, f"other.test:{env.origin.port}", sni="other.test")
    sock.sendall(
        f"GET https://api.test:{env.origin.port}/abs-form HTTP/1.1\r\nHost: other.test:{env.origin.port}\r\n\r\n".encode()
    )
    response = read_response(sock)
    assert status_of(response) in (400, 421, 0)
    _never_reached(env, "/abs-form")
    # Records are committed in writer batches: wait for it rather than read the spool at once.
    env.proxy.log.wait_for(mark, lambda r: r["decision"] == "deny")


def test_missing_sni_for_named_host(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(env.proxy, f"api.test:{env.origin.port}", sni=None)
    sock.sendall(f"GET /no-sni HTTP/1.1\r\nHost: api.test:{env.origin.port}\r\n\r\n".encode())
    assert status_of(read_response(sock)) == 421
    _never_reached(env, "/no-sni")
    _deny_reason(env, mark, "name_mismatch")


def test_duplicate_host_headers(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(env.proxy, f"other.test:{env.origin.port}", sni="other.test")
    sock.sendall(
        f"GET /dup-host HTTP/1.1\r\nHost: other.test:{env.origin.port}\r\nHost: api.test\r\n\r\n".encode()
    )
    assert status_of(read_response(sock)) == 400
    _never_reached(env, "/dup-host")
    _deny_reason(env, mark, "duplicate_host")


def test_plain_http_absolute_url_disagrees_with_host(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock = socket.create_connection(("127.0.0.1", env.proxy.port), timeout=10)
    sock.sendall(
        f"GET http://plain.test:{env.plain.port}/plain-mismatch HTTP/1.1\r\nHost: api.test\r\n"
        f"Proxy-Authorization: {auth_header()}\r\n\r\n".encode()
    )
    assert status_of(read_response(sock)) == 421
    _never_reached(env, "/plain-mismatch")
    _deny_reason(env, mark, "name_mismatch")


def test_http2_authority_disagrees_with_connect_target(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(
        env.proxy, f"other.test:{env.origin.port}", sni="other.test", alpn=["h2"]
    )
    assert isinstance(sock, ssl.SSLSocket) and sock.selected_alpn_protocol() == "h2"
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(
        1,
        [
            (":method", "GET"),
            (":scheme", "https"),
            (":authority", f"api.test:{env.origin.port}"),
            (":path", "/h2-authority"),
        ],
        end_stream=True,
    )
    sock.sendall(conn.data_to_send())
    status = None
    sock.settimeout(10)
    while status is None:
        data = sock.recv(65536)
        if not data:
            break
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                status = dict(event.headers).get(b":status")
        sock.sendall(conn.data_to_send())
    assert status == b"421"
    _never_reached(env, "/h2-authority")
    _deny_reason(env, mark, "name_mismatch")


def test_idn_homograph_is_a_different_host(env: Env) -> None:
    """'api.test' spelt with a Cyrillic 'a' (U+0430) is xn--pi-6kc.test (as a client sends it), which no rule allows."""
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(env.proxy, f"xn--pi-6kc.test:{env.origin.port}", sni="xn--pi-6kc.test")
    sock.sendall(f"GET /idn HTTP/1.1\r\nHost: xn--pi-6kc.test:{env.origin.port}\r\n\r\n".encode())
    response = read_response(sock)
    assert status_of(response) == 403
    _never_reached(env, "/idn")
    record = env.proxy.log.wait_for(mark, lambda r: r["decision"] == "deny")
    assert record["reason"] == "no_matching_rule"
    assert TEAM_SECRET.encode() not in response


def test_non_canonical_punycode_connect_target(env: Env) -> None:
    mark = env.proxy.log.mark()
    _sock, response = connect_tunnel(env.proxy, f"xn--ls8h.test:{env.origin.port}", sni=None)
    assert status_of(response) == 400
    _deny_reason(env, mark, "invalid_host")


def test_trailing_dot_and_case_are_the_same_host(env: Env) -> None:
    """API.TEST. is api.test: it gets api.test's rules (including the admin deny), not a bypass."""
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(env.proxy, f"API.TEST.:{env.origin.port}", sni="api.test")
    sock.sendall(f"GET /admin/dot HTTP/1.1\r\nHost: api.test:{env.origin.port}\r\n\r\n".encode())
    assert status_of(read_response(sock)) == 403
    _never_reached(env, "/admin/dot")
    _deny_reason(env, mark, "rule_deny")


def test_raw_unicode_connect_target(env: Env) -> None:
    """A CONNECT naming the host in raw UTF-8 is refused outright, never guessed at."""
    sock = socket.create_connection(("127.0.0.1", env.proxy.port), timeout=10)
    target = f"\u0430pi.test:{env.origin.port}"
    sock.sendall(
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: {auth_header()}\r\n\r\n".encode()
    )
    response = read_response(sock)
    assert status_of(response) in (0, 400, 403)
    sock.sendall(f"GET /raw-idn HTTP/1.1\r\nHost: api.test:{env.origin.port}\r\n\r\n".encode())
    read_response(sock, timeout=2)
    _never_reached(env, "/raw-idn")


def test_http2_host_header_disagrees_with_authority(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(
        env.proxy, f"other.test:{env.origin.port}", sni="other.test", alpn=["h2"]
    )
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(
            client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False
        )
    )
    conn.initiate_connection()
    conn.send_headers(
        1,
        [
            (":method", "GET"),
            (":scheme", "https"),
            (":authority", f"other.test:{env.origin.port}"),
            (":path", "/h2-host-header"),
            ("host", f"api.test:{env.origin.port}"),
        ],
        end_stream=True,
    )
    sock.sendall(conn.data_to_send())
    status = None
    sock.settimeout(10)
    while status is None:
        try:
            data = sock.recv(65536)
        except OSError:
            break
        if not data:
            break
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                status = dict(event.headers).get(b":status")
            elif isinstance(event, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                status = b"refused"
        sock.sendall(conn.data_to_send())
    # mitmproxy's HTTP/2 stack may refuse the header block itself; otherwise Umbra answers 421.
    assert status in (b"421", b"refused")
    _never_reached(env, "/h2-host-header")
    if status == b"421":
        env.proxy.log.wait_for(mark, lambda r: r["reason"] == "name_mismatch")
