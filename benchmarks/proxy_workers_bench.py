"""Umbra with 1 and 2 workers vs stock mitmproxy vs Squid `ssl_bump`, in one run: req/s and the
proxy's CPU time per 1,000 requests, HTTPS keep-alive and a new connection per request.

Run: .venv/bin/python benchmarks/proxy_workers_bench.py [--requests 1500] [--connections 8]
     [--rounds 3]

Every proxy intercepts TLS (a CONNECT tunnel, its own CA, a fresh TLS session upstream) in front
of the same loopback TLS origin. CPU time is the proxy's process tree (utime + stime from /proc:
Umbra's supervisor and workers, Squid's master, kid and certificate helpers), sampled around
each measurement. Rounds are interleaved across proxies (so all see the same machine load) and the
median is reported. Squid needs Debian's `squid-openssl` (scripts/system-deps, benchmark-only); it
is configured in a temporary directory with its own port, generated CA and ssl_crtd database, and
the row is skipped with a message when it is not installed. The client is Python (threads), on the
same cores: the figures compare proxies, they are not any proxy's ceiling.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
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
    wait_listening,
)
from tests.proxy.harness import free_port

SQUID = Path("/usr/sbin/squid")
CERTGEN = Path("/usr/lib/squid/security_file_certgen")
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Target:
    name: str
    port: int
    ca: Path
    pid: int
    connect_host: str


def tree_cpu(root: int) -> float:
    """CPU seconds (user + system) of `root` and every live descendant."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / _TICK
    total = 0.0
    for pid, cpu in times.items():
        node = pid
        while node > 1:
            if node == root:
                total += cpu
                break
            node = parents.get(node, 0)
    return total


def _get(sock: object, origin_port: int) -> None:
    sock.sendall(  # type: ignore[attr-defined]
        f"GET /bench HTTP/1.1\r\nHost: 127.0.0.1:{origin_port}\r\n\r\n".encode()
    )
    response = read_response(sock)  # type: ignore[arg-type]
    if status_of(response) != 200:
        raise RuntimeError(f"request failed: {response[:200]!r}")


def run_load(
    target: Target, origin_port: int, total: int, connections: int, keep_alive: bool
) -> tuple[float, float]:
    """(requests/s, proxy CPU ms per 1,000 requests) for `total` requests over `connections`
    client threads."""
    per_thread = max(1, total // connections)
    errors: list[BaseException] = []

    def open_() -> object:
        return connect(
            target.port, origin_port, target.ca, connect_host=target.connect_host, timeout=30
        )

    def worker() -> None:
        try:
            if keep_alive:
                sock = open_()
                for _ in range(per_thread):
                    _get(sock, origin_port)
                sock.close()  # type: ignore[attr-defined]
            else:
                for _ in range(per_thread):
                    sock = open_()
                    _get(sock, origin_port)
                    sock.close()  # type: ignore[attr-defined]
        except BaseException as exc:  # reported after the run
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(connections)]
    cpu_before = tree_cpu(target.pid)
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    cpu = tree_cpu(target.pid) - cpu_before
    if errors:
        raise RuntimeError(f"{target.name}: {errors[0]!r}")
    done = per_thread * connections
    return done / elapsed, cpu * 1000 / done * 1000


class Squid:
    """Squid with `ssl_bump` (peek at step 1, then bump) in a temporary directory: its own port,
    generated CA and ssl_crtd database; it trusts only the origin's CA upstream (the chain is
    verified; the name is not, as Squid does not match the origin certificate's IP address SAN)."""

    def __init__(self, workdir: Path, origin_ca: Path) -> None:
        self.dir = workdir
        self.port = free_port()
        self.service = f"u13b{os.getpid()}"
        self.ca = workdir / "squid-ca.pem"
        key = workdir / "squid-ca.key"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=u13b squid bench CA", "-keyout", str(key), "-out", str(self.ca),
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
            check=True, capture_output=True,
        )  # fmt: skip
        shutil.copy(origin_ca, workdir / "origin-ca.pem")
        ssl_db = workdir / "ssl_db"
        subprocess.run(
            [str(CERTGEN), "-c", "-s", str(ssl_db), "-M", "16MB"], check=True, capture_output=True
        )
        conf = workdir / "squid.conf"
        conf.write_text(
            f"""
http_port 127.0.0.1:{self.port} ssl-bump generate-host-certificates=on dynamic_cert_mem_cache_size=16MB tls-cert={self.ca} tls-key={key}
sslcrtd_program {CERTGEN} -s {ssl_db} -M 16MB
sslcrtd_children 4 startup=2 idle=1
acl step1 at_step SslBump1
ssl_bump peek step1
ssl_bump bump all
tls_outgoing_options cafile={workdir / "origin-ca.pem"}
acl name_mismatch ssl_error SQUID_X509_V_ERR_DOMAIN_MISMATCH
sslproxy_cert_error allow name_mismatch
sslproxy_cert_error deny all
http_access allow all
cache deny all
access_log none
cache_store_log none
cache_log {workdir / "cache.log"}
pid_filename {workdir / "squid.pid"}
coredump_dir {workdir}
shutdown_lifetime 0 seconds
cache_effective_user proxy
"""
        )
        # Squid drops to the `proxy` user: it owns this directory, and may traverse the parents.
        user = pwd.getpwnam("proxy")
        for path in [workdir, *workdir.rglob("*")]:
            os.chown(path, user.pw_uid, user.pw_gid)
        workdir.parent.chmod(0o711)
        self.process = subprocess.Popen(
            # A service name of its own: Squid names its shared-memory segments after it.
            [str(SQUID), "-N", "-n", self.service, "-f", str(conf)],
            stdout=(workdir / "squid.out").open("wb"),
            stderr=subprocess.STDOUT,
        )
        try:
            wait_listening(self.port, self.process, "squid")
        except RuntimeError:
            log = "".join(
                path.read_text(errors="replace")[-1500:]
                for path in (workdir / "squid.out", workdir / "cache.log")
                if path.exists()
            )
            raise RuntimeError(f"squid did not start: {log}") from None

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        for segment in Path("/dev/shm").glob(f"{self.service}-*"):  # noqa: S108 (ours, by name)
            segment.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    stops: list[Callable[[], object]] = []
    with tempfile.TemporaryDirectory(prefix=f"u13b-workers-bench-{os.getpid()}-") as tmp:
        workdir = Path(tmp)
        try:
            origin = start_origin(workdir)
            stops.append(origin.stop)
            targets: list[Target] = []
            for workers in (1, 2):
                wdir = workdir / f"umbra-{workers}"
                wdir.mkdir()
                umbra = start_umbra(wdir, origin, extra=("--workers", str(workers)))
                stops.append(umbra.stop)
                targets.append(
                    Target(
                        f"umbra --workers {workers}",
                        umbra.port,
                        umbra.ca,
                        umbra.process.pid,
                        "127.0.0.1",
                    )
                )
            stock_dir = workdir / "stock"
            stock_dir.mkdir()
            stock, stock_port = start_stock(stock_dir, origin.ca)
            stops.append(stock.terminate)
            targets.append(
                Target("stock mitmproxy", stock_port, stock_ca(stock_dir), stock.pid, "127.0.0.1")
            )
            if SQUID.exists() and CERTGEN.exists():
                squid_dir = workdir / "squid"
                squid_dir.mkdir()
                squid = Squid(squid_dir, origin.ca)
                stops.append(squid.stop)
                targets.append(
                    Target("squid ssl_bump", squid.port, squid.ca, squid.process.pid, "127.0.0.1")
                )
            else:
                print("squid-openssl is not installed (scripts/system-deps): no Squid row")
            for target in targets:  # warm up: certificates generated, connections made
                run_load(target, origin.port, 2 * args.connections, args.connections, True)
            results: dict[tuple[str, bool], list[tuple[float, float]]] = {}
            for _ in range(args.rounds):
                for keep_alive in (True, False):
                    for target in targets:
                        results.setdefault((target.name, keep_alive), []).append(
                            run_load(
                                target, origin.port, args.requests, args.connections, keep_alive
                            )
                        )
        finally:
            for stop in reversed(stops):
                stop()
    print(
        f"{args.requests} requests x {args.rounds} rounds, {args.connections} client connections, medians"
    )
    print(f"{'proxy':<20}{'mode':<16}{'req/s':>9}{'CPU ms/1k req':>15}")
    for (name, keep_alive), runs in results.items():
        rps = statistics.median(run[0] for run in runs)
        cpu = statistics.median(run[1] for run in runs)
        mode = "keep-alive" if keep_alive else "new conn/req"
        print(f"{name:<20}{mode:<16}{rps:>9.0f}{cpu:>15.0f}")


if __name__ == "__main__":
    main()
