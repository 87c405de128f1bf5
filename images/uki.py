"""The Unified Kernel Image the CVM disk boots: systemd's UEFI stub (Debian's systemd-boot-efi,
taken from the image, trixie's 257) with the os-release, the fixed kernel command line, the
kernel and the initrd added as PE sections by `objcopy` (the same layout code as on bookworm,
whose 252 had no ukify). For Secure Boot it is then signed (images.secure_boot).

One PE file holds the whole boot payload, so the firmware's measurement of it (the Authenticode
hash, images.pe) covers kernel, initrd and command line together. The command line is fixed:
the root file system's dm-verity root hash (images.verity; the initramfs opens the root only
through it, read-only), `panic=` (a failed boot reboots, it never opens a shell on the console
the host can type into), the serial console the clouds and the CI boot read.
The same four inputs give the same bytes (the PE timestamp is the stub's, the section
addresses follow from the inputs' sizes only).
"""

from __future__ import annotations

import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from umbra.images.disk_formats import (
    CloudDisks,
    DiskFormatError,
    build_cloud_disks,
)
from umbra.images.oci import file_sha256
from umbra.images.pe import PeError, authenticode_digest, parse, with_timestamp
from umbra.images.verity import format_verity

VERITY_DEVICE = "/dev/mapper/umbra-root"  # made by images/os/initramfs/local-top
OS_RELEASE = 'ID=debian\nVERSION_ID="13"\nPRETTY_NAME="Umbra CVM (Debian 13 trixie)"\n'
PAGE = 0x1000
UKI_NAME = "umbra-uki.efi"
UNSIGNED_UKI_NAME = "umbra-uki.unsigned.efi"


@dataclass(frozen=True)
class Uki:
    path: Path
    sha256: str  # the file
    authenticode_sha384: str  # what a TDX firmware logs for it (RTMR1)
    authenticode_sha256: str  # what a TPM firmware logs for it (PCR 4, SHA-256 bank)


def kernel_cmdline(root_hash: str) -> str:
    return (
        f"root={VERITY_DEVICE} ro umbra.verity={root_hash} fsck.mode=skip panic=10 "
        "console=ttyS0 quiet systemd.show_status=1"
    )


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


def build_uki(kernel: Path, initrd: Path, stub: Path, out: Path, cmdline_text: str) -> Uki:
    try:
        stub_bytes = stub.read_bytes()
        layout = parse(stub_bytes)
    except (OSError, PeError) as exc:
        raise DiskFormatError(f"{stub}: not a usable UEFI stub: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="umbra-uki-") as tmp:
        osrel, cmdline = Path(tmp) / "os-release", Path(tmp) / "cmdline"
        osrel.write_text(OS_RELEASE)
        cmdline.write_text(cmdline_text)
        # Each section at the next page after the previous one, starting after the stub's image.
        vma = layout.image_base + _align(layout.size_of_image)
        args: list[str] = []
        for name, path in ((".osrel", osrel), (".cmdline", cmdline), (".linux", kernel),
                           (".initrd", initrd)):  # fmt: skip
            args += ["--add-section", f"{name}={path}", "--change-section-vma", f"{name}={vma:#x}"]
            vma = _align(vma + path.stat().st_size)
        out.unlink(missing_ok=True)
        done = subprocess.run(
            ["objcopy", *args, str(stub), str(out)], capture_output=True, text=True, check=False
        )
    if done.returncode != 0:
        raise DiskFormatError(f"objcopy (UKI) failed: {done.stderr.strip()}")
    # objcopy stamps the PE header with the wall clock (neither -D nor SOURCE_DATE_EPOCH stop
    # it in binutils 2.40): put back the stub's own stamp (0 in Debian's).
    (pe,) = struct.unpack_from("<I", stub_bytes, 0x3C)
    (stamp,) = struct.unpack_from("<I", stub_bytes, pe + 8)
    # Whole 8-byte units: a signature's certificate table starts 8-aligned at the end of the file
    # and signers pad up to it; padded here, the signed UKI's Authenticode hash (the RTMR1
    # event) equals the unsigned one's.
    data = out.read_bytes()
    out.write_bytes(with_timestamp(data + bytes(-len(data) % 8), stamp))
    return describe_uki(out)


def describe_uki(path: Path) -> Uki:
    data = path.read_bytes()
    try:
        return Uki(
            path,
            file_sha256(path),
            authenticode_digest(data, "sha384"),
            authenticode_digest(data, "sha256"),
        )
    except PeError as exc:
        raise DiskFormatError(f"{path}: {exc}") from None


@dataclass(frozen=True)
class UkiSigner:
    """The release's Secure Boot key (PEM, RSA-2048) and certificate (images.secure_boot)."""

    key: Path
    cert: Path


def pack_os_image(
    os_dir: Path,
    out: Path,
    epoch: int,
    signer: UkiSigner | None = None,
    cloud_formats: bool = True,
) -> tuple[Uki, CloudDisks]:
    """images.os_image's output directory → the root's dm-verity hash tree, the UKI whose
    command line carries its root hash (signed for Secure Boot when `signer` is given), then the
    bootable cloud disks (`cloud_formats` False: the raw disk only, what QEMU boots)."""
    files = {n: os_dir / n for n in ("rootfs.ext4", "vmlinuz", "initrd.img", "linuxx64.efi.stub")}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise DiskFormatError(f"{os_dir}: not an OS image directory, missing {', '.join(missing)}")
    out.mkdir(parents=True, exist_ok=True)
    tree = format_verity(files["rootfs.ext4"], out / "rootfs.verity")
    unsigned = out / (UKI_NAME if signer is None else UNSIGNED_UKI_NAME)
    uki = build_uki(files["vmlinuz"], files["initrd.img"], files["linuxx64.efi.stub"],
                    unsigned, kernel_cmdline(tree.root_hash))  # fmt: skip
    if signer is not None:
        from umbra.images.secure_boot import sign_uki  # it builds on this module

        uki = sign_uki(unsigned, signer.key, signer.cert, out / UKI_NAME, epoch)
        unsigned.unlink()
    disks = build_cloud_disks(files["rootfs.ext4"], tree, uki.path, out, epoch, cloud_formats)
    tree.hash_tree.unlink()  # inside disk.raw now
    return uki, disks
