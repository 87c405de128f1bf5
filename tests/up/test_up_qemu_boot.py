"""`umbra up --runtime qemu --check` from a clean state directory, for real: the `qemu` OS image
built (or taken from the cache by its inputs' key), the Console started with its `qemu` provider,
the developer's Dev CVM launched through the Console's API and booted under QEMU (TCG here) in
the Azure shape (`UMBRA_TEST_SHAPE=gcp` for the other; the GCP shape's day is
tests/images/test_emulated_walkthrough.py's, with the Security CVM a VM too), then the seed's day
against it, every step passing: enrollment, `umbra ssh` into the VM's sandbox, an allowed request
with the token injected and a denied one and their records, stop and start, the workspace kept
and re-enrollment by a fresh quote. `umbra status` shows the VM with its QEMU; `umbra down` stops
it by the power button and leaves no process of the stack, QEMU included. One heavy test (two
TCG boots and a stop, 10-20 min on a loaded 2-core machine): run it under
`flock /tmp/umbra-heavy.lock`. Its step seconds are printed (`BENCH` lines:
benchmarks/emulated_walkthrough_bench.py reads them)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from umbra.cli.up_stack import vms
from umbra.emulated.qemu import OVMF

from .test_up import Up, _free_base, _leftovers, _require_root

pytestmark = pytest.mark.timeout(3600)
SHAPE = os.environ.get("UMBRA_TEST_SHAPE", "azure")
STEPS = (
    "launch through the Console",
    "enrollment",
    "umbra ssh",
    "an allowed and a denied request, recorded",
    "stop and start",
    "reboot: workspace kept",
    "reboot: re-enrollment",
)


def test_up_runtime_qemu_boots_the_image_through_the_console_and_down_leaves_nothing(
    tmp_path: Path,
) -> None:
    _require_root()
    if shutil.which("qemu-system-x86_64") is None or not OVMF.is_file():
        pytest.skip("needs qemu-system-x86_64 and OVMF (scripts/system-deps)")
    (tmp_path / "home").mkdir()
    env = {
        **os.environ,
        "HOME": str(tmp_path / "home"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "NO_COLOR": "1",
        "COLUMNS": "200",
    }
    for opt_in in ("UMBRA_STATE_DIR", "UMBRA_SIMULATED_PKI", "UMBRA_SSH_IDENTITY"):
        env.pop(opt_in, None)
    up = Up(tmp_path / "state", _free_base(), f"uqb{os.getpid() % 100000}", env)
    try:
        done = up.run("up", "--runtime", "qemu", "--shape", SHAPE, "--check", "--json",
                      timeout=3000)  # fmt: skip
        assert done.stdout, done.stderr
        result = json.loads(done.stdout)
        steps = result.get("check", {}).get("steps")
        assert steps, (result, done.stderr, up.logs())
        print(json.dumps(steps, indent=2))
        cvm = result["dev_cvm_id"]
        assert result["runtime"] == "qemu" and result["shape"] == SHAPE
        assert set(steps) == set(STEPS), steps  # (--json sorts keys)
        for name in STEPS:
            assert steps[name]["ok"], (name, steps[name], up.logs())
        assert result["ok"] is True and done.returncode == 0
        assert "token injected" in steps["an allowed and a denied request, recorded"]["detail"]
        assert "no new token" in steps["reboot: re-enrollment"]["detail"]
        launch = steps["launch through the Console"]["seconds"]
        ssh = launch + steps["enrollment"]["seconds"] + steps["umbra ssh"]["seconds"]
        restart = steps["stop and start"]["seconds"] + steps["reboot: workspace kept"]["seconds"]
        print(f"BENCH up-qemu shape={SHAPE} launch_to_ssh={ssh:.1f} restart_to_ssh={restart:.1f}")
        assert SHAPE in steps["launch through the Console"]["detail"]

        # `umbra status` shows the VM and its QEMU; the stack is healthy.
        status = up.json("status")
        (vm,) = status["dev_cvms"]
        assert vm["cvm_id"] == cvm and vm["runtime"] == "qemu" and vm["shape"] == SHAPE
        assert vm["qemu_pid"] and vm["healthy"], status
        assert status["healthy"], status

        # `umbra down`: the power button (the guest shuts itself down), then everything else.
        stopped = up.json("down")
        assert stopped["ok"], stopped
        assert f"qemu vm {cvm} (acpi)" in stopped["stopped"], stopped
        assert vms.vms(up.stack()) == []
        assert _leftovers(up) == []
        assert up.run("status").returncode == 1
    finally:
        up.run("down")
