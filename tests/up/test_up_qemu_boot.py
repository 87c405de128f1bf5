"""`umbra up --runtime qemu --check` from a clean state directory, for real: the `qemu` OS image
built (or taken from the cache by its inputs' key), the Console started with its `qemu` provider,
the developer's Dev CVM launched through the Console's API and booted under QEMU (TCG here) in
the GCP shape (`UMBRA_TEST_SHAPE=azure` for the other), then the seed's day against it; `umbra
status` shows the VM with its QEMU; `umbra down` stops it by the power button and leaves no
process of the stack, QEMU included.

Until the image carries the Dev workload, its compose command is a stub (cli/up_stack/os_disk.py)
and the steps that need the workload must fail at once with `NO_WORKLOAD` as their reason;
once it does, every step must pass. One heavy test (two TCG boots and a stop, 10-30 min on a
loaded 2-core machine): run it under `flock /tmp/umbra-heavy.lock`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from umbra.cli.up_check_qemu import NO_WORKLOAD, STUB_LINE
from umbra.cli.up_stack import vms
from umbra.emulated.qemu import OVMF

from .test_up import Up, _free_base, _leftovers, _require_root

pytestmark = pytest.mark.timeout(3600)
SHAPE = os.environ.get("UMBRA_TEST_SHAPE", "gcp")
# Work on today's image: the VM through the Console, stop and start, the data disk kept.
WITHOUT_WORKLOAD = {"launch through the Console", "stop and start", "reboot: workspace kept"}
NEEDS_WORKLOAD = {
    "enrollment",
    "umbra ssh",
    "an allowed and a denied request, recorded",
    "reboot: re-enrollment",
}


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
        serials = sorted((up.state / "qemu" / cvm).glob("serial-*.log"))
        workload = not any(STUB_LINE in p.read_text(errors="replace") for p in serials)
        assert set(steps) == WITHOUT_WORKLOAD | NEEDS_WORKLOAD, steps
        for name in WITHOUT_WORKLOAD:
            assert steps[name]["ok"], (name, steps[name], up.logs())
        for name in NEEDS_WORKLOAD:
            if workload:
                assert steps[name]["ok"], (name, steps[name], up.logs())
            else:
                assert not steps[name]["ok"] and NO_WORKLOAD in steps[name]["detail"], steps
                # Refused at once, never a wait to a deadline.
                assert steps[name]["seconds"] < 30, steps[name]
        assert result["ok"] is workload and done.returncode == (0 if workload else 1)
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
