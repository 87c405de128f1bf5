"""Boot the built CVM OS image's disk once under QEMU + OVMF (TCG: no KVM, no TDX here) with a GCP
metadata stand-in, and check that the launch agent runs at boot, measures, and starts the compose.

The boot is the cloud's: no -kernel, the firmware finds the ESP on the disk and runs the UKI at
/EFI/BOOT/BOOTX64.EFI (the kernel, initrd and command line inside it), which mounts the root
partition by its fixed PARTUUID through dm-verity (the root hash is in the UKI's command line),
read-only. A second boot from a copy of the disk with one byte of a file flipped on the root
partition stops in a kernel panic before the launch agent runs.

The boot is the emulated GCP's (umbra.emulated): SMBIOS says Google, so the agent takes GCP's path
and reads its launch data from the metadata stand-in at 169.254.169.254:80 (QEMU user networking
forwards it to loopback). The compose command is a stub that prints the compose file's SHA-256 on
the serial console (the image has no Docker: the container path is tested under real Docker); the
TEE is the host's simulated TDX module (umbra.emulated.tdx_module) on a virtio-serial port. tests/images/test_emulated_walkthrough.py boots qemu.yaml as shipped (both roles) in both cloud shapes
through stop and start.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from umbra.attest.simpki import SimulatedPki
from umbra.components.launch_data import LaunchData
from umbra.emulated.metadata import EmulatedMetadata, Shape
from umbra.emulated.qemu import Firmware, VmConfig, create_data_disk, qemu_argv
from umbra.emulated.tdx_module import TdxModule
from umbra.images.disk_formats import ROOT_PART_UUID, VERITY_PART_UUID, CloudDisks, esp_image
from umbra.images.measure import measure
from umbra.images.os_image import OsImage
from umbra.images.secure_boot import (
    OVMF_SECBOOT_CODE,
    OVMF_VARS_TEMPLATE,
    SecureBootError,
    ovmf_vars,
    sign_uki,
    verify_signature,
)
from umbra.images.uki import Uki, UkiSigner

from ..sandbox.fixtures import dev_definition
from .conftest import need_root_and
from .sb_keys import make_signer

OVMF = Path("/usr/share/ovmf/OVMF.fd")
TDX_SOCKET = "tdx.sock"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice"
NONCE = hashlib.sha512(b"umbra-emulated-boot").digest()
STUB = """#!/bin/sh
# CI boot test only: report the compose file the agent handed over, and what the root is, on the
# serial console.
QUOTE='import base64, hashlib; from umbra.attest.tdx_port import TdxModuleSource as S; print(base64.b64encode(S().get_quote(hashlib.sha512(b"umbra-emulated-boot").digest())).decode())'
echo "umbra-compose-stub: up $(sha256sum "$2" | cut -d' ' -f1)" > /dev/ttyS0
echo "umbra-compose-stub: root $(grep ' / ' /proc/mounts | cut -d' ' -f1,3,4)" > /dev/ttyS0
echo "umbra-compose-stub: verity $(veritysetup status umbra-root | tr -s ' \\n' ' ')" > /dev/ttyS0
echo "umbra-compose-stub: write $(touch /umbra-probe 2>&1)" > /dev/ttyS0
echo "umbra-compose-stub: rw $(grep -E ' /(etc|var|tmp) ' /proc/mounts | cut -d' ' -f1-3 | tr '\\n' ' ')" > /dev/ttyS0
echo "umbra-compose-stub: etc $(touch /etc/umbra-probe && echo writable)" > /dev/ttyS0
echo "umbra-compose-stub: secureboot $(dmesg | grep -o -m1 'Secure boot [a-z]*') lockdown $(cat /sys/kernel/security/lockdown)" > /dev/ttyS0
w=/var/lib/umbra/data/dev-host; mkdir -p $w; n=$(($(cat $w/boots 2>/dev/null || echo 0) + 1)); echo $n > $w/boots; sync
echo "umbra-compose-stub: data $(grep ' /var/lib/umbra/data ' /proc/mounts | cut -d' ' -f1,3) boots $n cloud $(cat /sys/class/dmi/id/sys_vendor)" > /dev/ttyS0
echo "umbra-compose-stub: kernel $(uname -r) tsm $(ls -d /sys/kernel/config/tsm/report) modules $(cut -d' ' -f1 /proc/modules | grep -E '^(tsm_report|tdx_guest|dm_verity|configfs)$' | sort | tr '\n' ' ')" > /dev/ttyS0
# The emulated TEE: a quote from the host's TDX module over the guest's port, and the log the
# services serve with it (the host verifies both).
echo "umbra-compose-stub: quote $(/opt/python/bin/python -c "$QUOTE" 2>&1 | tr -d '\n')" > /dev/ttyS0
echo "umbra-compose-stub: event-log $(base64 -w0 /run/umbra/launch/event-log.json)" > /dev/ttyS0
# With a TPM attached (tests/images/test_boot_measurements.py): the firmware's and the stubs' TCG2
# event log and the PCRs the UKI's measurements land in.
echo "umbra-compose-stub: tpm-log $(base64 -w0 /sys/kernel/security/tpm0/binary_bios_measurements 2>&1)" > /dev/ttyS0
echo "umbra-compose-stub: tpm-pcrs $(for i in 4 5 9 11 12; do printf '%s=%s ' $i "$(cat /sys/class/tpm/tpm0/pcr-sha256/$i 2>&1)"; done)" > /dev/ttyS0
"""
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture
def metadata(tmp_path: Path) -> Iterator[EmulatedMetadata]:
    """The emulated GCP's metadata server with a Dev CVM's launch data, and the host's TDX
    module the image's agent measures into (`--tee emulated`), on the test's TDX_SOCKET."""
    m = measure(dev_definition())
    data = LaunchData(
        role="dev-cvm",
        team="team-a",
        cvm_id="dev-qemu-1",
        app_compose=m.app_compose.decode(),
        ssh_authorized_keys=(KEY,),
    )
    module = TdxModule(tmp_path / TDX_SOCKET, SimulatedPki.generate(), "umbra-dev-cvm")
    with module.serving(), EmulatedMetadata(Shape.gcp, data, "dev-qemu-1").serving() as stand_in:
        yield stand_in


def _qemu(
    disk: Path,
    serial: Path,
    stand_in: EmulatedMetadata | None,
    secure_vars: Path | None = None,
) -> subprocess.Popen[bytes]:
    """QEMU + OVMF booting `disk` as the emulated cloud does (umbra.emulated.qemu: the cloud's
    SMBIOS, its metadata address forwarded to `stand_in`, a blank data disk). With
    `secure_vars` (a copy of the variable store with our PK/KEK/db, Secure Boot on), OVMF's
    Secure Boot build, which needs SMM and secure pflash. Without `stand_in`, no NIC and no
    data disk (a boot the firmware refuses never gets to PXE)."""
    firmware = Firmware() if secure_vars is None else Firmware(OVMF_SECBOOT_CODE, secure_vars)
    if stand_in is not None:
        data_disk = serial.parent / "data.raw"
        create_data_disk(data_disk, 1)
        argv = qemu_argv(
            VmConfig(
                stand_in.shape, disk, data_disk, serial, serial.parent / "qmp.sock",
                stand_in.metadata_port, stand_in.wire_port, firmware,
                tdx_module=serial.parent / TDX_SOCKET,  # the `metadata` fixture's, same tmp_path
            )
        )  # fmt: skip
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return subprocess.Popen(
        # -cpu max: RDRAND, as a TD's CPU has, which seeds the kernel's CRNG at once. TCG's
        # default qemu64 has none, and under 7.3 the CRNG then stayed uninitialized for minutes:
        # getrandom() blocked and the agent's Python with it.
        ["qemu-system-x86_64", *firmware.argv(), "-accel", "tcg", "-cpu", "max", "-m", "1024",
         "-smp", "1",
         # snapshot: the boot writes to a temporary overlay; the disk-format test reads the disk.
         "-drive", f"file={disk},format=raw,if=virtio,snapshot=on", "-net", "none",
         "-display", "none", "-monitor", "none", "-serial", f"file:{serial}", "-no-reboot"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def _watch(qemu: subprocess.Popen[bytes], serial: Path, done: re.Pattern[str], limit: float) -> str:
    """The serial log once `done` matches it, QEMU exits (-no-reboot: a reboot ends it), or
    `limit` seconds pass."""
    deadline = time.monotonic() + limit
    text = ""
    while time.monotonic() < deadline:
        exited = qemu.poll() is not None
        text = serial.read_text(errors="replace") if serial.exists() else ""
        if done.search(text) or exited:
            break
        time.sleep(3)
    return text


def _need_qemu() -> None:
    need_root_and("qemu-system-x86_64")
    for firmware in (OVMF, OVMF_SECBOOT_CODE, OVMF_VARS_TEMPLATE):
        if not firmware.exists():
            pytest.skip(f"needs {firmware} (Debian ovmf; scripts/system-deps installs it)")


@pytest.fixture(scope="module")
def secure_vars_template(sb_signer: UkiSigner, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OVMF's variable store with this run's release certificate as PK, KEK and db, Secure Boot
    on: what the image's secure-boot-db.json asks GCP and Azure to enroll."""
    return ovmf_vars(sb_signer.cert, tmp_path_factory.mktemp("uim-vars") / "vars.fd")


def _vars(template: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "vars.fd"  # the firmware writes its store: one copy per boot
    shutil.copyfile(template, copy)
    return copy


def test_os_image_boots_and_the_agent_starts_the_compose(
    qemu_disks: tuple[Uki, CloudDisks],
    secure_vars_template: Path,
    metadata: EmulatedMetadata,
    tmp_path: Path,
) -> None:
    """The signed disk under OVMF's Secure Boot firmware with our db enrolled (as a cloud with
    the image's Secure Boot db would boot it) all the way to the compose."""
    _need_qemu()
    data = metadata.launch
    _uki, disks = qemu_disks
    built = time.monotonic()  # the disks are a session fixture (shared with the disk formats)
    serial = tmp_path / "serial.log"
    qemu = _qemu(disks.raw, serial, metadata, _vars(secure_vars_template, tmp_path))
    want = f"umbra-compose-stub: up {hashlib.sha256(started_file(data)).hexdigest()}"
    try:
        # The agent's last line comes after the stub (the compose command) has returned.
        text = _watch(qemu, serial, re.compile(r"umbra-launch: .*(started|REFUSED)"), 900)
        print(f"boot to compose {time.monotonic() - built:.0f} s")
        assert want in text, f"no compose start on the serial console; tail:\n{text[-3000:]}"
        assert (
            f"umbra-launch: dev-cvm dev-qemu-1 started, compose-hash {data.compose_sha256}" in text
        )
        assert "metadata GET /computeMetadata/v1/instance/attributes/?recursive=true" in (
            metadata.requests
        )
        # OVMF booted the disk (its removable-media path), not a kernel handed to it by QEMU.
        assert re.search(r'BdsDxe: starting Boot[0-9A-F]{4} "UEFI Misc Device"', text)
        # The root is the dm-verity device, checked against the root hash in the UKI's command
        # line, mounted read-only: the running system cannot write it either.
        h = disks.verity_root_hash
        assert f"dm-verity, root hash {h})" in text
        assert "umbra-compose-stub: root /dev/mapper/umbra-root ext4 ro," in text
        verity = re.search(r"umbra-compose-stub: verity (.*)", text)
        assert verity is not None, text[-3000:]
        assert "type: VERITY" in verity[1] and "status: verified" in verity[1]
        assert f"root hash: {h}" in verity[1]
        assert "umbra-compose-stub: write touch: cannot touch '/umbra-probe': Read-only" in text
        # What it writes goes to tmpfs in the TD's memory: overlays on /etc and /var, /tmp.
        rw = re.search(r"umbra-compose-stub: rw (.*)", text)
        assert rw is not None, text[-3000:]
        for mount in ("umbra-etc /etc overlay", "umbra-var /var overlay", "tmpfs /tmp tmpfs"):
            assert mount in rw[1]
        assert "umbra-compose-stub: etc writable" in text
        # The kernel saw Secure Boot on (boot_params) and so Debian's kernel locked itself down
        # (lockdown is off otherwise: LOCK_DOWN_KERNEL_FORCE_NONE); the kernel is trixie-
        # backports' TDX guest kernel with configfs-tsm; no TDX here, so no tdx_guest.
        assert (
            "umbra-compose-stub: secureboot Secure boot enabled "
            "lockdown none [integrity] confidentiality" in text
        )
        kernel = re.search(r"umbra-compose-stub: kernel (\S+) tsm (\S*) modules (.*)", text)
        assert kernel is not None, text[-3000:]
        assert kernel[1].endswith("-cloud-amd64") and kernel[1].startswith("7.")
        assert kernel[2] == "/sys/kernel/config/tsm/report"
        assert kernel[3].split() == ["configfs", "dm_verity", "tsm_report"]
        assert "umbra-tee: not a TDX guest (tdx-guest did not load); tsm_report loaded" in text
    finally:
        qemu.kill()
        qemu.wait(30)


# Read by systemd early in the boot, before the agent: a corrupted block there must stop it.
TAMPERED = "/etc/systemd/system/umbra-launch-agent.service"


def test_a_flipped_byte_in_the_root_stops_the_boot_before_the_agent(
    qemu_os_image: OsImage,
    qemu_disks: tuple[Uki, CloudDisks],
    metadata: EmulatedMetadata,
    tmp_path: Path,
) -> None:
    """What a cloud host could do to the disk before boot: one byte of a file's data on the root
    partition, in a copy of disk.raw. The UKI (so RTMR1) is unchanged; dm-verity refuses."""
    _need_qemu()
    need_root_and("debugfs")
    _uki, disks = qemu_disks
    block = _first_block(qemu_os_image.rootfs, TAMPERED)
    (root,) = [p for p in _partitions(disks.raw) if p["uuid"].lower() == ROOT_PART_UUID]
    offset = root["start"] * 512 + block * 4096
    tampered = tmp_path / "disk.raw"
    subprocess.run(["cp", "--sparse=always", str(disks.raw), str(tampered)], check=True)
    with tampered.open("r+b") as f:
        f.seek(offset)
        original = f.read(1)
        f.seek(offset)
        f.write(bytes([original[0] ^ 0x01]))
    assert original == b"#"  # the unit file's first byte: the block is the file's
    serial = tmp_path / "serial.log"
    qemu = _qemu(tampered, serial, metadata)
    try:
        text = _watch(qemu, serial, re.compile(r"umbra-launch:|Kernel panic"), 600)
        text = _watch(qemu, serial, re.compile("Rebooting in"), 30)  # the panic's last words
        assert "umbra-launch:" not in text, text[-3000:]
        assert not metadata.requests, "the tampered CVM asked the metadata server for its data"
        assert re.search(r"device-mapper: verity: .*data block \d+ is corrupted", text), text[
            -3000:
        ]
        assert "Kernel panic - not syncing: dm-verity device corrupted" in text
        # The panic reboots (panic= in the UKI's command line; -no-reboot ends QEMU): the boot
        # stops there, with no shell on the console.
        assert qemu.wait(60) is not None
    finally:
        qemu.kill()
        qemu.wait(30)


def test_a_wiped_hash_tree_stops_the_boot_in_the_initramfs(
    qemu_disks: tuple[Uki, CloudDisks],
    metadata: EmulatedMetadata,
    tmp_path: Path,
) -> None:
    """The host wipes the verity superblock: `veritysetup open` fails in the initramfs, which
    says so and reboots (panic=): no shell, no fallback to mounting the raw root partition."""
    _need_qemu()
    _uki, disks = qemu_disks
    (part,) = [p for p in _partitions(disks.raw) if p["uuid"].lower() == VERITY_PART_UUID]
    tampered = tmp_path / "disk.raw"
    subprocess.run(["cp", "--sparse=always", str(disks.raw), str(tampered)], check=True)
    with tampered.open("r+b") as f:
        f.seek(part["start"] * 512)
        f.write(bytes(4096))
    serial = tmp_path / "serial.log"
    qemu = _qemu(tampered, serial, metadata)
    try:
        text = _watch(qemu, serial, re.compile(r"umbra-launch:|Rebooting automatically"), 600)
        assert "umbra-verity: FAILED: veritysetup open" in text, text[-3000:]
        assert "Rebooting automatically due to panic= boot argument" in text
        assert qemu.wait(60) is not None
        text = serial.read_text(errors="replace")
        assert "umbra-launch:" not in text and "umbra-verity: root" not in text
        assert "Welcome to" not in text  # systemd never started: the root was never mounted
        assert not metadata.requests
    finally:
        qemu.kill()
        qemu.wait(30)


def _partitions(disk: Path) -> list[dict[str, Any]]:
    table: list[dict[str, Any]] = json.loads(
        subprocess.run(["sfdisk", "--json", str(disk)], capture_output=True, check=True).stdout
    )["partitiontable"]["partitions"]
    return table


def _first_block(rootfs: Path, path: str) -> int:
    """The file's first data block in the ext4 image (debugfs bmap, read-only)."""
    done = subprocess.run(
        ["debugfs", "-R", f"bmap {path} 0", str(rootfs)], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip().isdigit(), done.stderr
    return int(done.stdout)


def started_file(data: LaunchData) -> bytes:
    """What the agent hands its starter (the stub here): the Security CVM's compose file or the
    Dev CVM's host definition (dev-cvm.json), as the measured app-compose.json carries it."""
    doc = json.loads(data.app_compose)
    started: str = (
        doc["docker_compose_file"] if "docker_compose_file" in doc else doc["dev_cvm_host"]
    )
    return started.encode()


def test_secure_boot_runs_only_the_uki_the_release_key_signed(
    qemu_disks: tuple[Uki, CloudDisks],
    sb_signer: UkiSigner,
    secure_vars_template: Path,
    tmp_path: Path,
) -> None:
    """Under the same firmware and db: the signed UKI starts (its initramfs's first line is
    enough, the full boot is the test above), and an unsigned UKI, the signed one with one byte
    of its command line changed, and one signed by another key are refused by the firmware
    before any of it runs. Each refused boot is an ESP alone on a disk: it never gets further."""
    _need_qemu()
    uki, _disks = qemu_disks
    signed = uki.path.read_bytes()
    unsigned = tmp_path / "unsigned.efi"
    subprocess.run(["sbattach", "--remove", str(_copy(uki.path, unsigned))], check=True)
    altered = tmp_path / "altered.efi"
    at = signed.index(b"panic=10")
    altered.write_bytes(signed[: at + 6] + b"9" + signed[at + 7 :])  # panic=90
    foreign = tmp_path / "foreign.efi"
    other = make_signer(tmp_path / "other", "not the release key")
    sign_uki(unsigned, other.key, other.cert, foreign, 1700000000)
    for bad in (unsigned, altered, foreign):
        with pytest.raises(SecureBootError):
            verify_signature(bad, sb_signer.cert)
    cases = [("signed", uki.path, True), ("unsigned", unsigned, False),
             ("altered", altered, False), ("foreign", foreign, False)]  # fmt: skip
    for name, efi, runs in cases:
        d = tmp_path / name
        d.mkdir()
        esp = esp_image(efi, d / "esp.img", 1700000000)
        serial = d / "serial.log"
        start = time.monotonic()
        qemu = _qemu(esp, serial, None, _vars(secure_vars_template, d))
        try:
            text = _watch(qemu, serial, re.compile(r"umbra-tee:|Access Denied|Violation"), 600)
        finally:
            qemu.kill()
            qemu.wait(30)
        print(f"secure boot, {name} UKI: {time.monotonic() - start:.0f} s")
        started = re.search(r'BdsDxe: starting Boot[0-9A-F]{4} "UEFI Non-Block Boot Device"', text)
        if runs:
            assert started and "umbra-tee:" in text, text[-3000:]
        else:
            assert re.search(
                r'BdsDxe: failed to load Boot[0-9A-F]{4} "UEFI Non-Block Boot Device".*: '
                r"Access Denied",
                text,
            ), f"{name}: {text[-3000:]}"
            assert not started and "umbra-tee:" not in text


def _copy(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    return dst
