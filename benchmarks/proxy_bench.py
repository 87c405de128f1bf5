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
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._proxy_setup import (
    connect,
    read_response,
    start_origin,
    start_stock,
    start_umbra,
    status_of,
    stock_ca,
)
from umbra.policy import deny_all
from umbra.proxy.scanner import Scanner
from umbra.proxy.secrets import SecretValue


def _open(mode: str, proxy_port: int | None, origin_port: int, ca: Path) -> ssl.SSLSocket:
    return connect(None if mode == "direct" else proxy_port, origin_port, ca,
                   connect_host="127.0.0.1", timeout=10)  # fmt: skip


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
    with tempfile.TemporaryDirectory(prefix="u-proxy-bench-") as tmp:
        workdir = Path(tmp)
        origin = start_origin(workdir)
        umbra = start_umbra(workdir, origin)
        stock_dir = workdir / "stock"
        stock_dir.mkdir()
        stock, stock_port = start_stock(stock_dir, origin.ca)
        try:
            direct = measure(
                "direct", None, origin.port, origin.ca, args.requests, args.connections
            )
            mitm = measure(
                "stock", stock_port, origin.port, stock_ca(stock_dir), args.requests,
                args.connections,
            )  # fmt: skip
            ours = measure(
                "umbra", umbra.port, origin.port, umbra.ca, args.requests, args.connections
            )
        finally:
            stock.terminate()
            umbra.stop()
            origin.stop()
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
