"""`umbra up --runtime qemu`, `umbra cvm update --state`, `status` and `down` end to end with the
hypervisor replaced: a stand-in `qemu-system-x86_64` first on PATH (fake_qemu/fake_qemu.py, run
under that name) that writes the launch agent's `umbra-launch: dev-cvm ID started` on the serial
console, serves QMP and exits on the power button. Everything else is real: the issuer, the
Console with its `qemu` provider (its metadata stand-in, TDX module, data disk), the TLS front,
the PCCS, the launch of both CVMs through the Console's API (the Security CVM a VM too, its
measured release the Console's), the stop and start through it (a second boot on the same data
disk). ~30 s; the real boot, with `--check`'s day, is test_up_qemu_boot.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from umbra.cli.up_stack import vms

from .test_up import Up, _free_base, _leftovers, _require_root

FAKE = Path(__file__).parent / "fake_qemu" / "fake_qemu.py"
DIGEST = "sha256:" + "ab" * 32


def test_up_runtime_qemu_wiring_with_a_stand_in_hypervisor(tmp_path: Path) -> None:
    _require_root()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    qemu = bin_dir / "qemu-system-x86_64"
    qemu.write_text(f'#!/bin/bash\nexec -a qemu-system-x86_64 {sys.executable} {FAKE} "$@"\n')
    qemu.chmod(0o755)
    disk = tmp_path / "disk.raw"
    disk.write_bytes(b"\0" * 4096)
    # The proxy image the disk would carry (os_disk.IMAGES): the Security release names it.
    (tmp_path / "images.json").write_text(json.dumps({"proxy": {"manifest_digest": DIGEST}}))
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
                      "--json", timeout=300)  # fmt: skip
        assert done.stdout, done.stderr
        result = json.loads(done.stdout)
        assert done.returncode == 0 and result["ok"] is True, result
        cvm = result["dev_cvm_id"]
        umbra = str(Path(sys.executable).parent / "umbra")

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([umbra, *args], capture_output=True, text=True, env=env,
                                  timeout=120)  # fmt: skip

        # Launched through the Console's API with the qemu provider, in the Azure shape.
        (record,) = [c for c in json.loads(cli("cvm", "list", "--json").stdout) if c["id"] == cvm]
        assert record["provider"] == "qemu" and record["state"] == "running", record
        assert record["provider_state"]["shape"] == "azure"
        # The reset button (the stand-in ends with QEMU's reset reason, as under -no-reboot):
        # the provider boots it again, a new TD on the same data disk; the record stays running.
        (vm,) = [v for v in vms.vms(up.stack()) if v.cvm_id == cvm]
        assert vm.qmp is not None and vm.qmp.name == "qmp.sock" and vms.reset(vm.qmp)
        boots = up.state / "qemu" / cvm / "fake-boots"
        end = time.monotonic() + 30
        while boots.read_text() != "2" and time.monotonic() < end:
            time.sleep(0.2)
        assert boots.read_text() == "2"
        (again,) = [c for c in json.loads(cli("cvm", "list", "--json").stdout) if c["id"] == cvm]
        assert again["state"] == "running", again
        # Stop (the power button: the stand-in exits) and start: a third boot, same data disk.
        for state in ("stopped", "running"):
            updated = cli("cvm", "update", cvm, "--state", state, "--wait", "--json")
            assert updated.returncode == 0, updated.stderr
        assert (up.state / "qemu" / cvm / "serial-3.log").exists()
        assert boots.read_text() == "3"
        # The launch data the VM got carries the Console's name and its TLS front's CA.
        config = json.loads((up.state / "qemu-cvms.json").read_text())
        assert config["console_url"] == "https://console.umbra.internal"
        # The Security CVM: a VM of the same provider, its measured release the Console's and
        # pinned by the Dev release, its proxy the disk's image.
        security = result["security_cvm_id"]
        (record,) = [c for c in json.loads(cli("cvm", "list", "--json").stdout)
                     if c["id"] == security]  # fmt: skip
        assert record["provider"] == "qemu" and record["kind"] == "security", record
        assert record["provider_state"]["tunnel"] == f"127.0.0.1:{up.base + 3}", record
        compose = json.loads((up.state / "qemu" / "security-app-compose.json").read_text())
        assert f"umbra/proxy@{DIGEST}" in compose["docker_compose_file"]
        release = json.loads((up.state / "security-cvm" / "release.json").read_text())
        (compose_hash,) = release["events"][0]["payloads"]
        assert compose_hash in (up.state / "qemu" / "app-compose.json").read_text()
        status = up.json("status")
        assert status["healthy"] and status["runtime"] == "qemu", status
        assert set(status["components"]) >= {"console-tls", "pccs"}
        assert "proxy" not in status["components"], status
        (vm,) = status["dev_cvms"]
        assert vm["cvm_id"] == cvm and vm["qemu_pid"] and vm["shape"] == "azure"
        assert vm["serial"].endswith("serial-3.log")
        (sec,) = status["security_cvms"]
        assert sec["cvm_id"] == security and sec["qemu_pid"], status
        stopped = up.json("down")
        assert {f"qemu vm {cvm} (acpi)", f"qemu vm {security} (acpi)"} <= set(stopped["stopped"])
        assert vms.vms(up.stack()) == [] and _leftovers(up) == []
    finally:
        up.run("down")
