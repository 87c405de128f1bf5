"""`umbra up --runtime qemu --check`, `status` and `down` end to end with the hypervisor replaced:
a stand-in `qemu-system-x86_64` first on PATH (fake_qemu/fake_qemu.py, run under that name) that
writes what the qemu image's stub and launch agent write on the serial console (the compose
stub's lines, a boot count kept beside the data disk, `umbra-launch: dev-cvm ID started`), serves
QMP and exits on the power button. Everything else is real: the issuer, the Console with its
`qemu` provider (its metadata stand-in, TDX module, data disk), the TLS front, the PCCS, the
Security CVM, the launch through the Console's API, the stop and start through it. ~30 s; the
real boot is test_up_qemu_boot.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from umbra.cli.up_check_qemu import NO_WORKLOAD
from umbra.cli.up_stack import vms

from .test_up import Up, _free_base, _leftovers, _require_root

FAKE = Path(__file__).parent / "fake_qemu" / "fake_qemu.py"


def test_up_runtime_qemu_wiring_with_a_stand_in_hypervisor(tmp_path: Path) -> None:
    _require_root()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    qemu = bin_dir / "qemu-system-x86_64"
    qemu.write_text(f'#!/bin/bash\nexec -a qemu-system-x86_64 {sys.executable} {FAKE} "$@"\n')
    qemu.chmod(0o755)
    disk = tmp_path / "disk.raw"
    disk.write_bytes(b"\0" * 4096)
    (tmp_path / "home").mkdir()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path / "home"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "UMBRA_UP_QEMU_DISK": str(disk),
        "NO_COLOR": "1",
        "COLUMNS": "200",
    }
    env.pop("UMBRA_STATE_DIR", None)
    up = Up(tmp_path / "state", _free_base(), f"uqw{os.getpid() % 100000}", env)
    try:
        done = up.run("up", "--runtime", "qemu", "--shape", "azure", "--accel", "tcg",
                      "--check", "--json", timeout=300)  # fmt: skip
        assert done.stdout, done.stderr
        result = json.loads(done.stdout)
        assert done.returncode == 1 and result["ok"] is False, result  # no workload: checks fail
        steps = result["check"]["steps"]
        assert {n for n, s in steps.items() if s["ok"]} == {
            "launch through the Console", "stop and start", "reboot: workspace kept",
        }, steps  # fmt: skip
        for name in ("enrollment", "umbra ssh", "an allowed and a denied request, recorded",
                     "reboot: re-enrollment"):  # fmt: skip
            assert NO_WORKLOAD in steps[name]["detail"], steps
        assert "boot count 1 → 2" in steps["reboot: workspace kept"]["detail"]
        cvm = result["dev_cvm_id"]
        # Launched through the Console's API with the qemu provider, in the Azure shape.
        listed = subprocess.run(
            [str(Path(sys.executable).parent / "umbra"), "cvm", "list", "--json"],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        (record,) = [c for c in json.loads(listed.stdout) if c["id"] == cvm]
        assert record["provider"] == "qemu" and record["state"] == "running", record
        assert record["provider_state"]["shape"] == "azure"
        # The launch data the VM got carries the Console's name and its TLS front's CA.
        config = json.loads((up.state / "qemu-cvms.json").read_text())
        assert config["console_url"] == "https://console.umbra.internal"
        status = up.json("status")
        assert status["healthy"] and status["runtime"] == "qemu", status
        assert set(status["components"]) >= {"console-tls", "pccs"}
        (vm,) = status["dev_cvms"]
        assert vm["cvm_id"] == cvm and vm["qemu_pid"] and vm["shape"] == "azure"
        assert vm["serial"].endswith("serial-2.log")
        stopped = up.json("down")
        assert stopped["stopped"][0] == f"qemu vm {cvm} (acpi)", stopped
        assert vms.vms(up.stack()) == [] and _leftovers(up) == []
    finally:
        up.run("down")
