"""A Console-launched Dev CVM on the emulated GCP (QEMU, TCG): launch to a working `umbra ssh`,
and start-after-stop to a working `umbra ssh`, with the host's CPU count (root).

One run is tests/images/test_emulated_dev_cvm.py (the `qemu` OS image built and packed, a real
Console with the `qemu` provider, the real `umbra ssh` CLI), which prints per boot:
- `disk`: the developer's launch (or the Console's start) to the launch agent mounting the data
  disk: firmware, kernel, dm-verity root, systemd; the **baseline** of the same run (the boot
  alone, before anything of the Dev workload);
- `enrolled`: to the forwarder's enrollment (`cvm.enroll`, after a stop `cvm.reenroll`) in the
  Console's audit: the dev host's start and the module's quote;
- `ssh`: to the first `umbra ssh -- <command>` that succeeds (the ingress, the client's
  attestation of the new TD, sshd, the sandbox).
Reported: each figure, and `ssh / disk` (what the Dev workload costs on top of the boot).

Run (root, nothing else heavy at the same time):
  flock /tmp/umbra-heavy.lock .venv/bin/python benchmarks/emulated_dev_cvm_bench.py
UMBRA_TEST_PREBUILT (tests/images/conftest.py) reuses an OS image build; UMBRA_TEST_ACCEL=kvm
where KVM works.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/images/test_emulated_dev_cvm.py"
LINE = re.compile(r"BENCH (launch|restart) disk=([\d.]+) enrolled=([\d.]+) ssh=([\d.]+)")


def main() -> int:
    if os.geteuid() != 0:
        print("needs root (image build, runc in the VM's host side, QEMU)", file=sys.stderr)
        return 2
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", TEST, "-x", "-q", "-s", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=os.environ | {"UMBRA_TEST_EMULATED_DEV": "1"},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    total = time.monotonic() - started
    found = {m[1]: tuple(float(x) for x in m.groups()[1:]) for m in LINE.finditer(done.stdout)}
    if done.returncode != 0 or set(found) != {"launch", "restart"}:
        print(done.stdout[-4000:], done.stderr[-2000:], file=sys.stderr)
        return 1
    load = os.getloadavg()
    print(
        f"emulated GCP, {os.environ.get('UMBRA_TEST_ACCEL', 'tcg')}, host nproc {os.cpu_count()}, "
        f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, whole test {total:.0f} s"
    )
    for kind, what in (("launch", "launch"), ("restart", "start after stop")):
        disk, enrolled, ssh = found[kind]
        print(
            f"  {what:>16}: data disk {disk:6.0f} s (baseline), enrolled {enrolled:6.0f} s, "
            f"working umbra ssh {ssh:6.0f} s  (ssh/disk {ssh / disk:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
