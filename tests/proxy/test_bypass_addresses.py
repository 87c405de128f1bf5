"""Bypass techniques against the address checks: IP literal spellings, IPv6 wrappings of loopback,
names resolving to private, metadata, CGNAT and ULA space, DNS rebinding, and the proxy itself.

The test proxy allows exactly 127.0.0.1/32 upstream (a test-only allowance for the origin servers);
every refusal below is of an address outside it, or of the proxy's own socket.
"""

from __future__ import annotations

import socket

import pytest

from tests.proxy.conftest import Env
from tests.proxy.harness import auth_header, connect_tunnel, read_response, status_of


def _never_reached(env: Env, marker: str) -> None:
    assert not any(marker in seen.path for seen in env.recorder.snapshot()), (
        "request reached origin"
    )


@pytest.mark.parametrize(
    "literal", ["2130706433", "0x7f.0.0.1", "127.1", "017700000001", "0177.0.0.1"]
)
def test_non_canonical_ipv4_literals_are_refused(env: Env, literal: str) -> None:
    mark = env.proxy.log.mark()
    _sock, response = connect_tunnel(env.proxy, f"{literal}:{env.origin.port}", sni=None)
    assert status_of(response) == 400
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "invalid_host")


@pytest.mark.parametrize(
    ("literal", "verdict"),
    [("[::ffff:127.0.0.1]", "address_loopback"), ("[64:ff9b::7f00:1]", "address_loopback")],
)
def test_ipv6_wrappings_of_loopback_are_refused(env: Env, literal: str, verdict: str) -> None:
    """The policy allows these literals; the address check still refuses what they carry."""
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(env.proxy, f"{literal}:{env.origin.port}", sni=None)
    sock.sendall(f"GET /wrapped HTTP/1.1\r\nHost: {literal}:{env.origin.port}\r\n\r\n".encode())
    assert status_of(read_response(sock)) == 502
    _never_reached(env, "/wrapped")
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == verdict)


@pytest.mark.parametrize(
    ("name", "verdict"),
    [
        ("private.test", "address_private"),
        ("metadata.test", "address_metadata"),
        ("cgnat.test", "address_cgnat"),
        ("ula.test", "address_ula"),
        ("loop2.test", "address_loopback"),  # one good and one bad answer: refused
    ],
)
def test_names_resolving_to_internal_addresses(env: Env, name: str, verdict: str) -> None:
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(env.proxy, f"{name}:{env.origin.port}", sni=name)
    sock.sendall(f"GET /internal HTTP/1.1\r\nHost: {name}:{env.origin.port}\r\n\r\n".encode())
    assert status_of(read_response(sock)) == 502
    record = env.proxy.log.wait_for(mark, lambda r: r["kind"] == "connection")
    assert record["reason"] == verdict
    assert record["cvm_id"] == "cvm-alice"


def test_dns_rebinding_second_lookup_is_checked(env: Env) -> None:
    """rebind.test answers 127.0.0.1 first and 10.0.0.7 afterwards; each dial resolves and checks."""
    sock, _ = connect_tunnel(env.proxy, f"rebind.test:{env.origin.port}", sni="rebind.test")
    sock.sendall(f"GET /rebind-1 HTTP/1.1\r\nHost: rebind.test:{env.origin.port}\r\n\r\n".encode())
    assert status_of(read_response(sock)) == 200
    mark = env.proxy.log.mark()
    sock2, _ = connect_tunnel(env.proxy, f"rebind.test:{env.origin.port}", sni="rebind.test")
    sock2.sendall(f"GET /rebind-2 HTTP/1.1\r\nHost: rebind.test:{env.origin.port}\r\n\r\n".encode())
    assert status_of(read_response(sock2)) == 502
    _never_reached(env, "/rebind-2")
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "address_private")


def test_proxy_cannot_be_pointed_at_itself(env: Env) -> None:
    """self.test resolves to 127.0.0.1 (allowed in tests) but the port is the proxy's own."""
    mark = env.proxy.log.mark()
    sock = socket.create_connection(("127.0.0.1", env.proxy.port), timeout=10)
    sock.sendall(
        f"GET http://self.test:{env.proxy.port}/loop HTTP/1.1\r\nHost: self.test:{env.proxy.port}\r\n"
        f"Proxy-Authorization: {auth_header()}\r\n\r\n".encode()
    )
    assert status_of(read_response(sock)) == 502
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "address_proxy_self")


def test_disallowed_port_on_allowed_host(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, _ = connect_tunnel(env.proxy, f"api.test:{env.tcp.port}", sni="api.test")
    sock.sendall(f"GET /other-port HTTP/1.1\r\nHost: api.test:{env.tcp.port}\r\n\r\n".encode())
    assert status_of(read_response(sock)) == 403
    env.proxy.log.wait_for(mark, lambda r: r["reason"] == "no_matching_rule")
    assert not env.recorder.contains(b"/other-port")
