"""Umbra proxy vs stock mitmproxy (no addon) vs direct, in one run; and scanner throughput.

Run: .venv/bin/python benchmarks/proxy_bench.py [--requests 2000] [--connections 4]

All three paths talk to the same loopback TLS origin over keep-alive HTTP/1.1 (through a CONNECT
tunnel for the two proxies). Reported per path: requests/s with N parallel connections, p50/p99
latency of sequential requests on one connection, and the latency each proxy adds over direct.
The target is Umbra within 15% of stock mitmproxy per request. Then the scanner alone: MB/s on
64 KiB and 10 MiB bodies (random bytes and JSON text).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.proxy.harness import (  # noqa: E402
    OriginServer,
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
from umbra.proxy.policy import deny_all  # noqa: E402
from umbra.proxy.scanner import Scanner  # noqa: E402
from umbra.proxy.secrets import SecretValue  # noqa: E402


def _open(mode: str, proxy_port: int | None, origin_port: int, ca: Path) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    if mode == "direct":
        sock = socket.create_connection(("127.0.0.1", origin_port), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return context.wrap_socket(sock)
    assert proxy_port is not None
    sock = socket.create_connection(("127.0.0.1", proxy_port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    target = f"127.0.0.1:{origin_port}"
    sock.sendall(
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: {auth_header()}\r\n\r\n".encode()
    )
    response = read_response(sock)
    if status_of(response) != 200:
        raise RuntimeError(f"CONNECT failed: {response[:200]!r}")
    return context.wrap_socket(sock)


def _request(sock: ssl.SSLSocket, origin_port: int) -> None:
    sock.sendall(f"GET /bench HTTP/1.1\r\nHost: 127.0.0.1:{origin_port}\r\n\r\n".encode())
    response = read_response(sock)
    if status_of(response) != 200:
        raise RuntimeError(f"request failed: {response[:200]!r}")


def measure(
    mode: str, proxy_port: int | None, origin_port: int, ca: Path, n: int, connections: int
) -> dict[str, float]:
    sock = _open(mode, proxy_port, origin_port, ca)
    for _ in range(50):
        _request(sock, origin_port)
    latencies = []
    for _ in range(n):
        start = time.perf_counter()
        _request(sock, origin_port)
        latencies.append(time.perf_counter() - start)
    sock.close()
    latencies.sort()
    per_thread = max(1, n // connections)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            conn = _open(mode, proxy_port, origin_port, ca)
            for _ in range(per_thread):
                _request(conn, origin_port)
            conn.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(connections)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{mode}: {errors[0]!r}")
    return {
        "rps": per_thread * connections / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
    }


def start_stock(
    workdir: Path, ca: Path, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    log = (workdir / "mitmdump.log").open("wb")
    process = subprocess.Popen(
        [
            str(ROOT / ".venv" / "bin" / "mitmdump"),
            "-q",
            "--listen-host",
            "127.0.0.1",
            "--listen-port",
            str(port),
            "--set",
            f"confdir={workdir / 'mitm-ca'}",
            "--set",
            f"ssl_verify_upstream_trusted_ca={ca}",
            "--set",
            "connection_strategy=lazy",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, port
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("stock mitmdump did not start")


def scanner_throughput() -> list[tuple[str, float]]:
    policy = deny_all()
    scanner = Scanner(
        policy.scan_rules, [SecretValue("team/bench", "BENCH-SECRET-VALUE-0123456789")]
    )
    text = json.dumps(
        [{"name": f"item{i}", "value": "some text here", "id": i} for i in range(200000)]
    ).encode()
    bodies = {
        "64 KiB random": os.urandom(64 << 10),
        "64 KiB JSON": text[: 64 << 10],
        "10 MiB random": os.urandom(10 << 20),
        "10 MiB JSON": (text * 2)[: 10 << 20],
    }
    results = []
    for name, body in bodies.items():
        rounds = 200 if len(body) < (1 << 20) else 3
        start = time.perf_counter()
        for _ in range(rounds):
            scanner.scan_request(b"POST /x HTTP/1.1\r\nHost: bench\r\n", body, "", 1 << 26)
        elapsed = time.perf_counter() - start
        results.append((name, len(body) * rounds / elapsed / 1e6))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--connections", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        ca = TestCA(workdir)
        cert, key = ca.issue(["bench.test"])
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(cert, key)
        origin = OriginServer(Recorder(), tls).start()
        origin.recorder.add = lambda item: None  # type: ignore[method-assign]
        policies = workdir / "policies"
        policies.mkdir()
        (policies / "bench.yaml").write_text(
            "apiVersion: umbra/v1\nkind: Profile\nname: testing\negress:\n"
            f'  - allow: {{hosts: ["127.0.0.1"], ports: [{origin.port}]}}\n'
        )
        identities = workdir / "identities.json"
        write_identities(identities)
        secrets = workdir / "secrets.json"
        write_secrets(secrets)
        umbra = start_proxy(
            [
                "--policy-dir",
                str(policies),
                "--identities",
                str(identities),
                "--secrets",
                str(secrets),
                "--upstream-ca",
                str(ca.cert_path),
                "--test-allow-upstream",
                "127.0.0.1/32",
            ],
            workdir,
        )
        stock, stock_port = start_stock(workdir, ca.cert_path)
        try:
            direct = measure(
                "direct", None, origin.port, ca.cert_path, args.requests, args.connections
            )
            mitm = measure(
                "stock",
                stock_port,
                origin.port,
                workdir / "mitm-ca" / "mitmproxy-ca-cert.pem",
                args.requests,
                args.connections,
            )
            ours = measure(
                "umbra", umbra.port, origin.port, umbra.ca, args.requests, args.connections
            )
        finally:
            stock.terminate()
            umbra.stop()
            origin.shutdown()
        print(f"{'path':<22}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'added p50 ms':>14}")
        for name, result in (("direct", direct), ("stock mitmproxy", mitm), ("umbra", ours)):
            added = result["p50_ms"] - direct["p50_ms"]
            print(
                f"{name:<22}{result['rps']:>10.0f}{result['p50_ms']:>10.2f}{result['p99_ms']:>10.2f}{added:>14.2f}"
            )
        ratio = ours["rps"] / mitm["rps"]
        added_ratio = (ours["p50_ms"] - direct["p50_ms"]) / max(
            1e-9, mitm["p50_ms"] - direct["p50_ms"]
        )
        print(f"umbra/stock throughput: {ratio:.2f}  (target >= 0.85)")
        print(f"umbra/stock added p50 latency: {added_ratio:.2f}  (target <= 1.15)")
    print()
    print(f"{'scanner body':<22}{'MB/s':>10}")
    for name, mbps in scanner_throughput():
        print(f"{name:<22}{mbps:>10.1f}")


if __name__ == "__main__":
    main()
