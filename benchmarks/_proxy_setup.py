"""What the proxy benchmarks share: the loopback TLS origin and its CA, the profile, `umbra proxy
serve`, stock mitmdump, and a client connection through a proxy's CONNECT tunnel.

Used by `proxy_bench.py`, `proxy_stream_bench.py` and `proxy_workers_bench.py`.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.proxy.harness import (  # noqa: E402
    OriginServer,
    ProxyProcess,
    Recorder,
    TestCA,
    auth_header,
    free_port,
    read_response,
    start_proxy,
    status_of,
    write_identities,
    write_secrets,
)

HOST = "bench.test"


@dataclass
class Origin:
    """A loopback TLS origin (the test harness's) for `bench.test` and 127.0.0.1."""

    server: OriginServer
    ca: Path

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self) -> None:
        self.server.shutdown()


def start_origin(workdir: Path) -> Origin:
    ca = TestCA(workdir)
    cert, key = ca.issue([HOST])
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server = OriginServer(Recorder(), tls).start()
    server.recorder.add = lambda item: None  # type: ignore[method-assign]  # nothing to record
    return Origin(server, ca.cert_path)


def start_umbra(
    workdir: Path, origin: Origin, *, inject: bool = False, extra: tuple[str, ...] = ()
) -> ProxyProcess:
    """`umbra proxy serve` with a profile allowing the origin (as `bench.test` and 127.0.0.1),
    optionally injecting a bearer credential for `bench.test`."""
    policies = workdir / "policies"
    policies.mkdir(exist_ok=True)
    profile = (
        "apiVersion: umbra/v1\nkind: Profile\nname: testing\negress:\n"
        f"  - allow: {{hosts: [{HOST}, 127.0.0.1], ports: [{origin.port}]}}\n"
    )
    if inject:
        profile += (
            "inject:\n  - {id: bearer, header: Authorization, format: 'Bearer {secret}',"
            f" secret: team/github-bot, hosts: [{HOST}], ports: [{origin.port}]}}\n"
        )
    (policies / "bench.yaml").write_text(profile)
    resolver = workdir / "resolver.json"
    resolver.write_text(json.dumps({HOST: ["127.0.0.1"]}))
    identities = workdir / "identities.json"
    write_identities(identities)
    secrets = workdir / "secrets.json"
    write_secrets(secrets)
    return start_proxy(
        ["--policy-dir", str(policies), "--identities", str(identities),
         "--secrets", str(secrets), "--upstream-ca", str(origin.ca),
         "--test-allow-upstream", "127.0.0.1/32", "--test-resolver", str(resolver), *extra],
        workdir,
    )  # fmt: skip


def start_stock(
    workdir: Path, ca: Path, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], int]:
    """Stock mitmdump (no addon) trusting the origin's CA; its own CA is under workdir/mitm-ca."""
    port = free_port()
    log = (workdir / "mitmdump.log").open("wb")
    process = subprocess.Popen(
        [str(ROOT / ".venv" / "bin" / "mitmdump"), "-q",
         "--listen-host", "127.0.0.1", "--listen-port", str(port),
         "--set", f"confdir={workdir / 'mitm-ca'}",
         "--set", f"ssl_verify_upstream_trusted_ca={ca}",
         "--set", "connection_strategy=lazy", *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait_listening(port, process, "stock mitmdump")
    return process, port


def stock_ca(workdir: Path) -> Path:
    return workdir / "mitm-ca" / "mitmproxy-ca-cert.pem"


def wait_listening(port: int, process: subprocess.Popen[bytes], name: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited ({process.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{name} did not start")


def connect(
    proxy_port: int | None,
    origin_port: int,
    cafile: Path,
    *,
    connect_host: str = HOST,
    timeout: float = 60,
) -> ssl.SSLSocket:
    """TLS to the origin, directly or through a proxy's CONNECT tunnel (Umbra's proxy
    credentials are sent; other proxies ignore them), with TCP_NODELAY."""
    if proxy_port is None:
        sock = socket.create_connection(("127.0.0.1", origin_port), timeout=timeout)
    else:
        sock = socket.create_connection(("127.0.0.1", proxy_port), timeout=timeout)
        target = f"{connect_host}:{origin_port}"
        sock.sendall(
            f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
            f"Proxy-Authorization: {auth_header()}\r\n\r\n".encode()
        )
        response = read_response(sock)
        if status_of(response) != 200:
            sock.close()
            raise RuntimeError(f"CONNECT refused: {response[:200]!r}")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    context = ssl.create_default_context(cafile=str(cafile))
    context.check_hostname = False
    return context.wrap_socket(sock, server_hostname=connect_host)


__all__ = [
    "HOST",
    "Origin",
    "ProxyProcess",
    "connect",
    "read_response",
    "start_origin",
    "start_stock",
    "start_umbra",
    "status_of",
    "stock_ca",
    "wait_listening",
]
