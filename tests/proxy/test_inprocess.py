"""The proxy run in-process (`ProxyThread`), with production address checks: no test allowance."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

from tests.proxy.conftest import Env
from tests.proxy.harness import TrafficLog, auth_header, read_response, status_of
from tests.proxy.proxy_thread import ProxyThread
from umbra.proxy.config import ProxyConfig


def test_in_process_proxy_refuses_loopback_without_the_test_allowance(
    env: Env, tmp_path: Path
) -> None:
    config = ProxyConfig(
        listen_host="127.0.0.1",
        listen_port=0,
        policy_dir=env.policy_dir,
        identities=env.identities,
        secrets=env.secrets,
        traffic_log=tmp_path / "spool",
        confdir=tmp_path / "ca",
        upstream_ca=env.ca.cert_path,
        test_resolver=env.resolver,
    )
    runner = ProxyThread(config)
    port = runner.start()
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        target = f"other.test:{env.origin.port}"
        sock.sendall(
            f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
            f"Proxy-Authorization: {auth_header()}\r\n\r\n".encode()
        )
        assert status_of(read_response(sock)) == 200
        context = ssl.create_default_context(cafile=str(tmp_path / "ca" / "mitmproxy-ca-cert.pem"))
        tls = context.wrap_socket(sock, server_hostname="other.test")
        tls.sendall(f"GET /inproc HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        assert status_of(read_response(tls)) == 502
        assert not env.recorder.contains(b"/inproc")
        TrafficLog(tmp_path / "spool").wait_for(0, lambda r: r["reason"] == "address_loopback")
    finally:
        runner.stop()


def test_udp_to_the_proxy_port_goes_nowhere(env: Env) -> None:
    """No UDP listener exists: a QUIC Initial sent to the proxy's port gets no answer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(1)
    sock.connect(("127.0.0.1", env.proxy.port))
    sock.send(b"\xc3\x00\x00\x00\x01" + b"\x00" * 1195)
    try:
        data = sock.recv(2048)
    except (TimeoutError, ConnectionRefusedError):
        data = b""
    assert data == b""
