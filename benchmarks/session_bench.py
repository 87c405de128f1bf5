"""Attested time-to-shell vs plain OpenSSH to the same gateway sshd, cold and with connection
reuse, all in one run so the ratios compare like with like.

- plain cold:     ssh, ProxyCommand = the gateway's own `sshd -i` (same config, host key,
                  ForceCommand into the sandbox): what OpenSSH alone costs per connection.
- attested cold:  ssh, the fast ProxyCommand (warm agent, fd passing; per connection: Console
                  lookup, aTLS, simulated quote, full verification, known_hosts pin) → ingress →
                  the same `sshd -i`. "one process": the same checks in `python -m
                  umbra.cli.ssh_proxy`, paying interpreter start and imports each time.
- reused:         both again through an established ControlMaster (`ssh -S … true`).
Each sample runs `true` in the sandbox. Targets (issue #10): attested cold ≤ plain cold + 0.3 s;
attested reused ≤ 1.2 x plain reused.

Run (root: namespaces and a root sshd): .venv/bin/python benchmarks/session_bench.py [-n N]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.console.helpers import start_server, unique  # noqa: E402
from tests.console.oidc_issuer import LocalIssuer  # noqa: E402
from tests.session import harness  # noqa: E402
from tests.session.conftest import make_developer  # noqa: E402
from umbra.policy.bundle import generate_key  # noqa: E402

PHASES = """
import time, sys
t0 = time.perf_counter()
import asyncio
from umbra.cli import ssh_attest, ssh_proxy
t1 = time.perf_counter()
info = ssh_proxy.fetch_session(sys.argv[1])
t2 = time.perf_counter()
ssh_attest.collateral_and_root(True)
t3 = time.perf_counter()
async def go():
    s = await ssh_attest.connect_attested(info)
    await s.conn.close()
asyncio.run(go())
t4 = time.perf_counter()
print(f"imports {t1 - t0:.3f}  console {t2 - t1:.3f}  simulated-pki+collateral {t3 - t2:.3f}"
      f"  aTLS+verify (incl. pki again) {t4 - t3:.3f}")
"""


def _time(argv: list[str], env: dict[str, str], n: int) -> list[float]:
    out = []
    for _ in range(n + 1):  # first run is a warm-up
        t0 = time.perf_counter()
        done = subprocess.run(argv, env=env, capture_output=True, timeout=60)
        out.append(time.perf_counter() - t0)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[:3]}… failed: {done.stderr.decode()[-300:]}")
    return out[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--iterations", type=int, default=10)
    n = parser.parse_args().iterations
    harness.require_tools = lambda: None
    work = Path(tempfile.mkdtemp(prefix="uss-bench-"))
    issuer = LocalIssuer()
    console = start_server(
        "sqlite", f"sqlite:///{work}/c.db", work / "c.db", issuer.url, generate_key(), work
    )
    try:
        pki = harness.simulated_pki(work / "pki")
        dev = make_developer(console, issuer, pki, work)
        # the developer fixture's env is what ssh and the ProxyCommand read
        os.environ.update({k: v for k, v in dev.env.items() if k.startswith(("UMBRA_", "XDG_"))})
        os.environ["TMPDIR"] = dev.env["TMPDIR"]
        from umbra.cli.ssh_config import ssh_argv

        with harness.sandbox() as box:
            cvm_id = dev.create_cvm(unique("bench"))
            (work / "cvm").mkdir()
            with harness.ingress(box, work / "cvm", cvm_id, [dev.pub], pki) as ing:
                dev.record(cvm_id, port=ing.port, release=harness.release_manifest())
                attested = ssh_argv(cvm_id, reuse=False)
                alias = attested[-1]
                # plain: same options, but ssh talks straight to the gateway's sshd -i
                from umbra.sandbox.gateway_sshd import HOST_KEY, sshd_argv
                from umbra.sandbox.ingress_config import load_ingress_config

                direct = shlex.join(
                    sshd_argv(load_ingress_config(ing.config), ing.state_dir / HOST_KEY)
                )

                def swap(argv: list[str], command: str) -> list[str]:
                    out = [
                        f"ProxyCommand={command}" if a.startswith("ProxyCommand=") else a
                        for a in argv
                    ]
                    return [a.replace("ProxyUseFdpass=yes", "ProxyUseFdpass=no") for a in out]

                plain = swap(attested, direct)
                one_process = swap(
                    attested, shlex.join([sys.executable, "-m", "umbra.cli.ssh_proxy", cvm_id])
                )
                env = dict(os.environ)
                results: dict[str, list[float]] = {}
                # attested first: it pins the attested host key that plain ssh then checks too
                results["attested cold"] = _time([*attested, "true"], env, n)
                results["plain cold"] = _time([*plain, "true"], env, n)
                results["attested cold, one process"] = _time([*one_process, "true"], env, n)
                for label, argv in (("plain", plain), ("attested", attested)):
                    sock = str(work / f"cm-{label}")
                    base = [a.replace("ControlPath=none", f"ControlPath={sock}") for a in argv[:-1]]
                    master = subprocess.Popen([*base, "-M", "-N", alias], env=env)
                    try:
                        deadline = time.monotonic() + 30
                        while not Path(sock).exists():
                            if time.monotonic() > deadline:
                                raise RuntimeError("control master did not start")
                            time.sleep(0.05)
                        results[f"{label} reused"] = _time([*base, alias, "true"], env, n)
                    finally:
                        master.terminate()
                        master.wait(timeout=10)
                phases = subprocess.run(
                    [sys.executable, "-c", PHASES, cvm_id], env=env, capture_output=True, text=True
                )
        med = {k: statistics.median(v) for k, v in results.items()}
        print(f"session_bench: {n} samples each, median (p90) seconds")
        for key, values in results.items():
            p90 = sorted(values)[max(0, int(0.9 * len(values)) - 1)]
            print(f"  {key:27} {med[key]:.3f} ({p90:.3f})")
        extra = med["attested cold"] - med["plain cold"]
        ratio = med["attested reused"] / med["plain reused"]
        print(f"  attested cold - plain cold = {extra:+.3f} s   (target ≤ +0.300 s)")
        one = med["attested cold, one process"] - med["plain cold"]
        print(f"  attested cold (one process) - plain cold = {one:+.3f} s")
        print(f"  one cold ProxyCommand, seconds: {phases.stdout.strip() or phases.stderr[-300:]}")
        print(f"  attested reused / plain reused = {ratio:.2f}x   (target ≤ 1.20x)")
    finally:
        harness.stop_agents(Path(os.environ.get("TMPDIR", work)))
        console.stop()
        issuer.close()
        subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    main()
