"""The UKI and its ESP from stand-in payloads (no OS image build, no root): reproducible bytes,
the sections the stub reads, and the Authenticode hash's coverage (what the firmware measures)."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from umbra.images.disk_formats import ESP_PATH, ESP_VOLUME_ID, DiskFormatError, esp_image
from umbra.images.pe import authenticode_digest, parse
from umbra.images.uki import build_uki, kernel_cmdline

STUB = Path("/usr/lib/systemd/boot/efi/linuxx64.efi.stub")
CMDLINE = kernel_cmdline("ab" * 32)


def _need(*cmds: str) -> None:
    if not STUB.exists():
        pytest.skip(f"needs {STUB} (Debian systemd-boot-efi; scripts/system-deps installs it)")
    for cmd in cmds:
        if shutil.which(cmd) is None:
            pytest.skip(f"needs {cmd} (scripts/system-deps installs it)")


@pytest.fixture
def payload(tmp_path: Path) -> tuple[Path, Path]:
    kernel, initrd = tmp_path / "vmlinuz", tmp_path / "initrd.img"
    kernel.write_bytes(bytes(range(256)) * 4000)
    initrd.write_bytes(b"initrd" * 50000)
    return kernel, initrd


def test_the_uki_is_reproducible_and_carries_the_boot_payload(
    payload: tuple[Path, Path], tmp_path: Path
) -> None:
    _need("objcopy", "objdump")
    kernel, initrd = payload
    a = build_uki(kernel, initrd, STUB, tmp_path / "a.efi", CMDLINE)
    b = build_uki(kernel, initrd, STUB, tmp_path / "b.efi", CMDLINE)
    assert a.path.read_bytes() == b.path.read_bytes()
    data = a.path.read_bytes()
    (pe,) = struct.unpack_from("<I", data, 0x3C)
    assert struct.unpack_from("<I", data, pe + 8) == (0,)  # the stub's stamp, not the clock
    sections = subprocess.run(
        ["objdump", "-h", str(a.path)], capture_output=True, text=True, check=True
    ).stdout
    for name in (".osrel", ".cmdline", ".linux", ".initrd"):
        assert f" {name} " in sections
    subprocess.run(
        ["objcopy", "-O", "binary", "--only-section=.cmdline", str(a.path), str(tmp_path / "c")],
        check=True,
    )
    assert (tmp_path / "c").read_text() == CMDLINE
    assert "root=/dev/mapper/umbra-root ro umbra.verity=" in CMDLINE and "console=ttyS0" in CMDLINE
    assert a.authenticode_sha384 == authenticode_digest(data, "sha384")


def test_the_authenticode_hash_covers_the_payload_not_the_checksum(
    payload: tuple[Path, Path], tmp_path: Path
) -> None:
    _need("objcopy")
    uki = build_uki(*payload, STUB, tmp_path / "u.efi", CMDLINE)
    data = bytearray(uki.path.read_bytes())
    layout = parse(bytes(data))
    # The checksum field is outside the hash (firmware does not rely on it) ...
    data[layout.checksum_offset] ^= 0xFF
    assert authenticode_digest(bytes(data)) == uki.authenticode_sha384
    # ... a byte of the kernel, the initrd or the command line is inside it.
    for ptr, size in layout.sections[-3:]:
        changed = bytearray(data)
        changed[ptr + size // 2] ^= 0xFF
        assert authenticode_digest(bytes(changed)) != uki.authenticode_sha384


def test_the_esp_is_reproducible_and_holds_the_uki(tmp_path: Path) -> None:
    _need("mkfs.vfat", "mcopy")
    uki = tmp_path / "uki.efi"
    uki.write_bytes(b"MZ" + bytes(300_000))
    a = esp_image(uki, tmp_path / "a.img", 1700000000)
    b = esp_image(uki, tmp_path / "b.img", 1700000000)
    assert a.read_bytes() == b.read_bytes()
    assert a.stat().st_size % (1 << 20) == 0
    got = subprocess.run(["mtype", "-i", str(a), ESP_PATH], capture_output=True, check=True)
    assert got.stdout == uki.read_bytes()
    info = subprocess.run(["minfo", "-i", str(a), "::"], capture_output=True, text=True).stdout
    assert f"serial number: {ESP_VOLUME_ID}" in info


def test_a_non_pe_stub_is_refused(payload: tuple[Path, Path], tmp_path: Path) -> None:
    bad = tmp_path / "stub"
    bad.write_bytes(b"not a PE file")
    with pytest.raises(DiskFormatError, match="not a usable UEFI stub"):
        build_uki(*payload, bad, tmp_path / "u.efi", CMDLINE)
