"""The proxy's CPU per 1,000 HTTPS keep-alive requests: Umbra vs stock mitmproxy in one run.

Run: .venv/bin/python benchmarks/proxy_cpu_bench.py [--requests 1000] [--rounds 3]
     [--connections 8] [--inject] [--profile DIR] [--baseline-tree DIR]

Both proxies intercept TLS (CONNECT, their own CA, a fresh TLS session upstream) in front of the
same loopback TLS origin; Umbra runs one process (`--workers 1`), stock mitmdump runs no addon.
CPU is the proxy process tree's utime + stime from /proc, sampled around each measurement; rounds
are interleaved across proxies (all see the same machine load) and the median of each is
reported, with Umbra's ratio to stock (the issue #23 target: <= 1.00x).

`--inject` adds an Umbra whose profile injects a bearer credential into every request (the client
then names the origin `bench.test`, the injection's host). `--baseline-tree DIR` adds an Umbra run
from another checkout (e.g. `git worktree add /tmp/base main`): its `src/` goes first on the
proxy's PYTHONPATH, with this checkout's venv. `--profile DIR` runs one more round, under cProfile
switched on and off by signals (so start-up and warm-up are not in it), and writes
`DIR/<proxy>.prof` and the top functions by own time as `DIR/<proxy>.txt` (profiled rounds are not
in the table: cProfile itself costs CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pstats
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._proxy_setup import (
    HOST,
    ROOT,
    connect,
    read_response,
    start_origin,
    start_stock,
    start_umbra,
    status_of,
    stock_ca,
)
from benchmarks.proxy_workers_bench import tree_cpu

# Loaded by the proxy's interpreter (PYTHONPATH) when profiling: one real-time signal starts
# cProfile on the main thread (where mitmproxy's event loop runs), the next stops it and writes the
# stats (mitmdump takes SIGUSR1 and SIGUSR2 for its own debug dumps).
_SITECUSTOMIZE = """
import cProfile, os, signal
_out = os.environ.get("UMBRA_BENCH_PROFILE")
if _out:
    _profiler = cProfile.Profile()
    def _start(signum, frame):
        _profiler.enable()
    def _stop(signum, frame):
        _profiler.disable()
        _profiler.dump_stats(_out)
    signal.signal(signal.SIGRTMIN + 3, _start)
    signal.signal(signal.SIGRTMIN + 4, _stop)
"""


@dataclass
class Target:
    name: str
    port: int
    ca: Path
    pid: int
    connect_host: str
    profile: Path | None = None


def _get(sock: object, host: str, origin_port: int) -> None:
    sock.sendall(  # type: ignore[attr-defined]
        f"GET /bench HTTP/1.1\r\nHost: {host}:{origin_port}\r\n\r\n".encode()
    )
    response = read_response(sock)  # type: ignore[arg-type]
    if status_of(response) != 200:
        raise RuntimeError(f"request failed: {response[:200]!r}")


def run_load(target: Target, origin_port: int, total: int, connections: int) -> float:
    """The proxy's CPU ms per 1,000 requests for `total` keep-alive requests over
    `connections` client threads (each one connection)."""
    per_thread = max(1, total // connections)
    errors: list[BaseException] = []
    # Connect (CONNECT + both TLS handshakes) before the window: only requests are measured.
    socks = [
        connect(target.port, origin_port, target.ca, connect_host=target.connect_host, timeout=30)
        for _ in range(connections)
    ]

    def worker(sock: object) -> None:
        try:
            for _ in range(per_thread):
                _get(sock, target.connect_host, origin_port)
        except BaseException as exc:  # reported after the run
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(sock,)) for sock in socks]
    cpu_before = tree_cpu(target.pid)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu = tree_cpu(target.pid) - cpu_before
    for sock in socks:
        sock.close()
    if errors:
        raise RuntimeError(f"{target.name}: {errors[0]!r}")
    return cpu * 1000 / (per_thread * connections) * 1000


@contextlib.contextmanager
def _environ(**values: str | None) -> Iterator[None]:
    """os.environ with `values` set (None: unset) for the proxies started inside."""
    saved = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _write_top(prof: Path, out: Path, limit: int = 40) -> None:
    with out.open("w") as handle:
        stats = pstats.Stats(str(prof), stream=handle)
        stats.sort_stats("tottime").print_stats(limit)
        stats.sort_stats("cumulative").print_stats(limit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inject", action="store_true", help="add Umbra injecting every request")
    parser.add_argument("--profile", type=Path, help="write cProfile stats of each proxy here")
    parser.add_argument("--baseline-tree", type=Path, help="add Umbra run from this checkout")
    args = parser.parse_args()
    if args.baseline_tree is not None and not (args.baseline_tree / "src" / "umbra").is_dir():
        parser.error(f"--baseline-tree {args.baseline_tree}: no src/umbra there")
    stops: list[Callable[[], object]] = []
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix=f"umbra-cpu-bench-{os.getpid()}-") as tmp:
        workdir = Path(tmp)
        site = workdir / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)

        def env(name: str, tree: Path | None = None) -> contextlib.AbstractContextManager[None]:
            # This checkout's code unless another tree is named (also when the venv's editable
            # install points elsewhere, e.g. the bench run from a snapshot of this tree).
            paths = [str((tree or ROOT) / "src")] if name != "stock" else []
            if args.profile is not None:
                paths.append(str(site))
            prof = str(args.profile.resolve() / f"{name}.prof") if args.profile else None
            return _environ(PYTHONPATH=os.pathsep.join(paths) or None, UMBRA_BENCH_PROFILE=prof)

        try:
            origin = start_origin(workdir)
            stops.append(origin.stop)
            targets: list[Target] = []
            variants: list[tuple[str, bool, Path | None]] = [("umbra", False, None)]
            if args.inject:
                variants.append(("umbra-inject", True, None))
            if args.baseline_tree is not None:
                variants.append(("baseline", False, args.baseline_tree.resolve()))
                if args.inject:
                    variants.append(("baseline-inject", True, args.baseline_tree.resolve()))
            for name, inject, tree in variants:
                wdir = workdir / name
                wdir.mkdir()
                with env(name, tree):
                    umbra = start_umbra(wdir, origin, inject=inject)
                stops.append(umbra.stop)
                targets.append(
                    Target(
                        name, umbra.port, umbra.ca, umbra.process.pid,
                        HOST if inject else "127.0.0.1",
                    )
                )  # fmt: skip
            stock_dir = workdir / "stock"
            stock_dir.mkdir()
            with env("stock"):
                stock, stock_port = start_stock(stock_dir, origin.ca)
            stops.append(stock.terminate)
            targets.append(Target("stock", stock_port, stock_ca(stock_dir), stock.pid, "127.0.0.1"))
            for target in targets:  # warm up: certificates generated, code paths taken
                run_load(target, origin.port, 20 * args.connections, args.connections)
            for _ in range(args.rounds):
                for target in targets:
                    results.setdefault(target.name, []).append(
                        run_load(target, origin.port, args.requests, args.connections)
                    )
            if args.profile is not None:
                for target in targets:
                    os.kill(target.pid, signal.SIGRTMIN + 3)
                    time.sleep(0.2)
                    run_load(target, origin.port, args.requests, args.connections)
                    os.kill(target.pid, signal.SIGRTMIN + 4)
                    prof = args.profile / f"{target.name}.prof"
                    for _ in range(100):
                        if prof.exists() and prof.stat().st_size:
                            break
                        time.sleep(0.1)
                    time.sleep(0.3)
                    _write_top(prof, args.profile / f"{target.name}.txt")
        finally:
            for stop in reversed(stops):
                stop()
    stock_cpu = statistics.median(results["stock"])
    print(
        f"{args.requests} keep-alive requests x {args.rounds} rounds, "
        f"{args.connections} client connections; medians"
    )
    print(f"{'proxy':<18}{'CPU ms/1k req':>15}{'vs stock':>10}   rounds")
    for name, runs in results.items():
        cpu = statistics.median(runs)
        each = " ".join(f"{run:.0f}" for run in runs)
        print(f"{name:<18}{cpu:>15.0f}{cpu / stock_cpu:>9.2f}x   {each}")
    if args.profile is not None:
        print(f"profiles: {args.profile}/<proxy>.prof and .txt (top functions)")


if __name__ == "__main__":
    main()
