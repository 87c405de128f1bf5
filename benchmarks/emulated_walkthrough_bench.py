"""The emulated cloud's day (QEMU, TCG): launch to a working `umbra ssh` in a Console-launched Dev
CVM, and start-after-stop to a working `umbra ssh`, per cloud shape, with the host's CPU count
(root).

One run is tests/images/test_emulated_walkthrough.py (the `qemu` OS image built and packed, a
real Console with the `qemu` provider, a Security CVM and a Dev CVM as VMs, the real `umbra ssh`
CLI), which prints per shape and boot, from the developer's launch (or the Console's start):
- `enrolled`: the forwarder's enrollment (`cvm.enroll`; after a stop `cvm.reenroll`) in the
  Console's audit: firmware, kernel, dm-verity root, systemd, the agent, the dev host's start
  and the module's quote; the **baseline** of the same run;
- `ssh`: the first `umbra ssh -- <command>` that succeeds (the ingress, the client's
  attestation of the new TD, sshd, the sandbox);
- `request`: the first allowed request from the sandbox through the Security CVM (its own boot,
  running alongside, and the forwarder's attestation of it).
Reported: each figure, and `ssh / enrolled` (what the attested session costs on top of a booted,
enrolled CVM).

Run (root, nothing else heavy at the same time):
  flock /tmp/umbra-heavy.lock .venv/bin/python benchmarks/emulated_walkthrough_bench.py [-k gcp]
UMBRA_TEST_PREBUILT (tests/images/conftest.py) reuses an image build; UMBRA_TEST_ACCEL=kvm where
KVM works.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/images/test_emulated_walkthrough.py"
LINE = re.compile(r"BENCH (launch|restart) enrolled=([\d.]+) ssh=([\d.]+) request=([\d.]+)")
SHAPE = re.compile(r"test_the_emulated_clouds_day\[(\w+)\]")


def main(argv: list[str]) -> int:
    if os.geteuid() != 0:
        print("needs root (image build, QEMU)", file=sys.stderr)
        return 2
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", TEST, "-v", "-s", "-p", "no:cacheprovider", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=7200,
    )
    total = time.monotonic() - started
    shape, found = "?", []
    for line in done.stdout.splitlines():
        named = SHAPE.search(line)
        if named:
            shape = named[1]
        m = LINE.search(line)
        if m:
            found.append((shape, m[1], *(float(x) for x in m.groups()[1:])))
    if done.returncode != 0 or not found:
        print(done.stdout[-4000:], done.stderr[-2000:], file=sys.stderr)
        return 1
    load = os.getloadavg()
    print(
        f"emulated clouds, {os.environ.get('UMBRA_TEST_ACCEL', 'tcg')}, host nproc "
        f"{os.cpu_count()}, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, "
        f"whole run {total:.0f} s"
    )
    for shape, kind, enrolled, ssh, request in found:
        what = "launch" if kind == "launch" else "start after stop"
        print(
            f"  {shape:>5} {what:>16}: enrolled {enrolled:6.0f} s (baseline), working umbra ssh "
            f"{ssh:6.0f} s (ssh/enrolled {ssh / enrolled:.2f}), first request {request:6.0f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
