"""`--workers 2`: two proxy processes on one port (SO_REUSEPORT), each spooling on its own."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.proxy.conftest import Env
from tests.proxy.harness import (
    TrafficLog,
    connect_tunnel,
    read_response,
    start_proxy,
    status_of,
)


def test_two_workers_share_the_port_and_spool_separately(env: Env, tmp_path: Path) -> None:
    proxy = start_proxy(
        ["--workers", "2", "--policy-dir", str(env.policy_dir), "--identities",
         str(env.identities), "--secrets", str(env.secrets), "--upstream-ca", str(env.ca.cert_path),
         "--test-allow-upstream", "127.0.0.1/32", "--test-resolver", str(env.resolver)],
        tmp_path,
    )  # fmt: skip
    try:
        assert "(2 workers)" in proxy.output.read_text()
        target = f"api.test:{env.origin.port}"
        for index in range(24):
            sock, _ = connect_tunnel(proxy, target, sni="api.test")
            sock.sendall(f"GET /w{index} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            assert status_of(read_response(sock)) == 200
            sock.close()
        logs = [TrafficLog(tmp_path / "spool" / f"worker-{index}") for index in range(2)]
        deadline = time.monotonic() + 10
        while sum(len(log.records()) for log in logs) < 24:
            assert time.monotonic() < deadline, "records missing from the workers' spools"
            time.sleep(0.1)
        # The kernel spread the connections: both workers served some (24 connections: a
        # one-sided split has probability 2**-23).
        assert all(log.records() for log in logs)
        assert all(r["cvm_id"] == "cvm-alice" for log in logs for r in log.records())
    finally:
        output = proxy.stop()
    assert "a worker exited" not in output


def test_a_dead_worker_stops_the_proxy(env: Env, tmp_path: Path) -> None:
    """Fail closed: the supervisor stops every worker when one dies."""
    proxy = start_proxy(
        ["--workers", "2", "--policy-dir", str(env.policy_dir), "--identities",
         str(env.identities), "--upstream-ca", str(env.ca.cert_path)],
        tmp_path,
    )  # fmt: skip
    try:
        children = Path(f"/proc/{proxy.process.pid}/task/{proxy.process.pid}/children")
        pids = [int(pid) for pid in children.read_text().split()]
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        proxy.process.wait(timeout=20)
        assert proxy.process.returncode != 0
        for pid in pids[1:]:
            deadline = time.monotonic() + 20
            while Path(f"/proc/{pid}").exists() and b"zombie" not in _state(pid):
                assert time.monotonic() < deadline, "a worker outlived the supervisor"
                time.sleep(0.1)
    finally:
        proxy.stop()


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().lower()
    except OSError:
        return b"zombie"
