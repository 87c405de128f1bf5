"""`umbra up` to a working `umbra ssh -- true`, and `umbra down`, on a warm machine (root).

"Working" means a developer's first attested SSH command succeeds: `umbra up`, then
`umbra ssh --no-reuse -- true` (Console session info, aTLS, quote verified, sshd, the sandbox).

Measured in one run, each against a baseline from the same run:
- cold: `umbra up` + `umbra ssh -- true` from an empty state directory (keys, PKI, migrations,
  first launch), and `umbra up --check` once on top (the walkthrough and its fifth, SSH, check);
- warm: `umbra down` then `umbra up` + `umbra ssh -- true` on the same state (target: <= 15 s);
- down: `umbra down` (the target: <= 5 s);
- baseline: `umbra --help` (the CLI's own start-up), so the ratios say what up itself costs.
`umbra up` alone is reported too (cold and warm), against the figures before the sandbox image
(cold 9.8 s, warm 5.6 s; goal warm <= 10 s). The sandbox image must already be cached (a first
`umbra up` builds it, once per machine, and says how long it took).

Run (root): .venv/bin/python benchmarks/up_bench.py [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UMBRA = str(ROOT / ".venv" / "bin" / "umbra")


def _base() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return min(int(sock.getsockname()[1]), 60000)


def _timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(argv[:3])} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return elapsed


def _up_to_ssh(where: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(`umbra up` alone, `umbra up` + `umbra ssh -- true`)."""
    up = _timed([UMBRA, "up", *where], env)
    return up, up + _timed([UMBRA, "ssh", "--no-reuse", "--", "true"], env)


def _stop_agents(tmp: str) -> None:
    """The warm ssh agents `umbra ssh` started under this TMPDIR."""
    for pid_file in Path(tmp).glob("umbra-ssh-*/agent-*.pid"):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("up_bench needs root (umbra up creates namespaces)")
    with tempfile.TemporaryDirectory(prefix="umbra-up-bench-") as tmp:
        env = {
            **os.environ,
            "XDG_CONFIG_HOME": f"{tmp}/config",
            "HOME": tmp,
            "TMPDIR": tmp,
            "UMBRA_UP_NAME_PREFIX": f"ubn{os.getpid() % 10000}",
        }
        where = ["--state-dir", f"{tmp}/state", "--port-base", str(_base())]
        try:
            baseline = statistics.median(_timed([UMBRA, "--help"], env) for _ in range(3))
            cold_up, cold = _up_to_ssh(where, env)
            check = _timed([UMBRA, "up", "--check", *where], env)
            warm, warm_up, down = [], [], []
            for _ in range(args.rounds):
                down.append(_timed([UMBRA, "down", *where], env))
                up_only, total = _up_to_ssh(where, env)
                warm_up.append(up_only)
                warm.append(total)
        finally:
            _stop_agents(tmp)
            subprocess.run([UMBRA, "down", *where], env=env, capture_output=True, timeout=120)
    w, d = statistics.median(warm), statistics.median(down)
    print(f"baseline `umbra --help`:            {baseline:6.2f} s")
    wu = statistics.median(warm_up)
    print(f"cold `umbra up` alone:              {cold_up:6.2f} s  (was 9.8 s)")
    print(f"warm `umbra up` alone (median):     {wu:6.2f} s  (was 5.6 s)  goal <= 10 s")
    print(f"cold `umbra up` + `ssh -- true`:    {cold:6.2f} s  ({cold / baseline:5.1f}x baseline)")
    print(f"`umbra up --check` (running stack): {check:6.2f} s  ({check / baseline:5.1f}x)")
    print(f"warm `up` + `ssh -- true` (median): {w:6.2f} s  ({w / baseline:5.1f}x)  target <= 15 s")
    print(f"`umbra down` (median):              {d:6.2f} s  ({d / baseline:5.1f}x)  target <= 5 s")


if __name__ == "__main__":
    main()
