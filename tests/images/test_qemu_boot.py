"""Boot the built CVM OS image's disk once under QEMU + OVMF (TCG: no KVM, no TDX here) with a GCP
metadata stand-in, and check that the launch agent runs at boot, measures, and starts the compose.

The boot is the cloud's: no -kernel, the firmware finds the ESP on the disk and runs the UKI at
/EFI/BOOT/BOOTX64.EFI (the kernel, initrd and command line inside it), which mounts the root
partition by its fixed PARTUUID.

The guest reaches the stand-in at 10.0.2.100:80 through QEMU's guestfwd. The compose command is a
stub that prints the compose file's SHA-256 on the serial console (the image has no Docker: the
container path is tested under real Docker); the TEE is simulated.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from umbra.components.launch_data import LaunchData
from umbra.images.disk_formats import CloudDisks
from umbra.images.measure import measure
from umbra.images.uki import Uki

from ..sandbox.fixtures import dev_definition
from .conftest import need_root_and

OVMF = Path("/usr/share/ovmf/OVMF.fd")
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice"
STUB = """#!/bin/sh
# CI boot test only: report the compose file the agent handed over, on the serial console.
echo "umbra-compose-stub: up $(sha256sum "$2" | cut -d' ' -f1)" > /dev/ttyS0
"""
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture
def metadata() -> Iterator[tuple[int, LaunchData, list[str]]]:
    m = measure(dev_definition())
    data = LaunchData(
        role="dev-cvm",
        team="team-a",
        cvm_id="dev-qemu-1",
        app_compose=m.app_compose.decode(),
        ssh_authorized_keys=(KEY,),
    )
    body = json.dumps(data.gcp_metadata()).encode()
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return None

        def do_GET(self) -> None:
            seen.append(self.path)
            ok = self.headers.get("Metadata-Flavor") == "Google"
            self.send_response(200 if ok else 403)
            self.send_header("Content-Length", str(len(body) if ok else 0))
            self.end_headers()
            if ok:
                self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], data, seen
    finally:
        server.shutdown()
        server.server_close()


def test_os_image_boots_and_the_agent_starts_the_compose(
    qemu_disks: tuple[Uki, CloudDisks],
    metadata: tuple[int, LaunchData, list[str]],
    tmp_path: Path,
) -> None:
    need_root_and("qemu-system-x86_64")
    if not OVMF.exists():
        pytest.skip(f"needs {OVMF} (Debian ovmf; scripts/system-deps installs it)")
    port, data, seen = metadata
    _uki, disks = qemu_disks
    built = time.monotonic()  # the disks are a session fixture (shared with the disk formats)
    serial = tmp_path / "serial.log"
    qemu = subprocess.Popen(
        ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-m", "1024", "-smp", "1",
         "-bios", str(OVMF),
         # -snapshot: the boot writes to a temporary overlay; the disk-format test reads the disk.
         "-drive", f"file={disks.raw},format=raw,if=virtio", "-snapshot",
         "-netdev", f"user,id=n0,guestfwd=tcp:10.0.2.100:80-tcp:127.0.0.1:{port}",
         "-device", "virtio-net-pci,netdev=n0",
         "-display", "none", "-monitor", "none", "-serial", f"file:{serial}", "-no-reboot"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    want = f"umbra-compose-stub: up {hashlib.sha256(_compose(data)).hexdigest()}"
    try:
        deadline = time.monotonic() + 900
        text = ""
        while time.monotonic() < deadline and qemu.poll() is None:
            text = serial.read_text(errors="replace") if serial.exists() else ""
            if want in text:
                break
            time.sleep(3)
        print(f"boot to compose {time.monotonic() - built:.0f} s")
        assert want in text, f"no compose start on the serial console; tail:\n{text[-3000:]}"
        assert (
            f"umbra-launch: dev-cvm dev-qemu-1 started, compose-hash {data.compose_sha256}" in text
        )
        assert any(p.startswith("/computeMetadata/v1/instance/attributes/") for p in seen)
        # OVMF booted the disk (its removable-media path), not a kernel handed to it by QEMU.
        assert re.search(r'BdsDxe: starting Boot[0-9A-F]{4} "UEFI Misc Device"', text)
    finally:
        qemu.kill()
        qemu.wait(30)


def _compose(data: LaunchData) -> bytes:
    compose: str = json.loads(data.app_compose)["docker_compose_file"]
    return compose.encode()
