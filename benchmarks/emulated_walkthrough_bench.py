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
enrolled CVM). Then, in the same run, `umbra up --runtime qemu --check` as a developer runs it
(tests/up/test_up_qemu_boot.py, the Azure shape in CI: its Security CVM and Dev CVM both VMs):
launch to a working `umbra ssh` (the baseline), the Dev VM's reset to one, and the pair's stop
and start to an allowed request, and their ratios.

Run (root, nothing else heavy at the same time; both shapes with
UMBRA_TEST_WALKTHROUGH_SHAPES=gcp,azure, CI's is gcp):
  flock /tmp/umbra-heavy.lock .venv/bin/python benchmarks/emulated_walkthrough_bench.py
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
UP_TEST = "tests/up/test_up_qemu_boot.py"
LINE = re.compile(r"BENCH (launch|restart) enrolled=([\d.]+) ssh=([\d.]+) request=([\d.]+)")
UP_LINE = re.compile(
    r"BENCH up-qemu shape=(\w+) launch_to_ssh=([\d.]+) reboot_to_ssh=([\d.]+) "
    r"restart_to_request=([\d.]+)"
)
SHAPE = re.compile(r"test_the_emulated_clouds_day\[(\w+)\]")


def main(argv: list[str]) -> int:
    if os.geteuid() != 0:
        print("needs root (image build, QEMU)", file=sys.stderr)
        return 2
    started = time.monotonic()
    done = _pytest(TEST, argv)
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
    up = _pytest(UP_TEST, [])
    ups = [(m[1], float(m[2]), float(m[3]), float(m[4])) for m in UP_LINE.finditer(up.stdout)]
    if up.returncode != 0 or not ups:
        print(up.stdout[-4000:], up.stderr[-2000:], file=sys.stderr)
        return 1
    load = os.getloadavg()
    print(
        f"emulated clouds, {os.environ.get('UMBRA_TEST_ACCEL', 'tcg')}, host nproc "
        f"{os.cpu_count()}, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, "
        f"walkthrough run {total:.0f} s"
    )
    for shape, kind, enrolled, ssh, request in found:
        what = "launch" if kind == "launch" else "start after stop"
        print(
            f"  {shape:>5} {what:>16}: enrolled {enrolled:6.0f} s (baseline), working umbra ssh "
            f"{ssh:6.0f} s (ssh/enrolled {ssh / enrolled:.2f}), first request {request:6.0f} s"
        )
    for shape, launch, reboot, restart in ups:
        print(
            f"  {shape:>5} umbra up --runtime qemu --check: launch to umbra ssh {launch:6.0f} s "
            f"(baseline), reset to umbra ssh {reboot:6.0f} s (reboot/launch "
            f"{reboot / launch:.2f}), stop and start of both to a request {restart:6.0f} s "
            f"(restart/launch {restart / launch:.2f})"
        )
    return 0


def _pytest(test: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    # The walkthrough's restart and up --check's reset are opt-in (CI leaves them out); the
    # figures need them.
    env = {**os.environ, "UMBRA_TEST_WALKTHROUGH_RESTART": "1", "UMBRA_TEST_UP_FULL": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", test, "-v", "-s", "-p", "no:cacheprovider", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=7200,
        env=env,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
