"""Cloud disk formats from the OS image (images.os_image): its root file system (`rootfs.ext4`)
and the Unified Kernel Image built from its kernel, initrd and stub (images.uki).

- `disk.raw`: a GPT disk (1 MiB aligned, fixed GUIDs) with three partitions: the EFI system
  partition (FAT32, the UKI at the removable-media path `/EFI/BOOT/BOOTX64.EFI`, which UEFI
  firmware boots without any boot entry), the root file system, and its dm-verity hash tree
  (images.verity; the root hash is in the UKI's command line). Size rounded up to whole GiB
  (GCP wants whole-GiB disks; Azure 1 MiB multiples). The same `rootfs.ext4` and UKI give the
  same bytes: the GPT's GUIDs and the FAT's volume id are fixed, the FAT is written by mtools
  (no mount) with SOURCE_DATE_EPOCH timestamps, and the copy keeps holes (the result is sparse).
- GCP: `disk.raw` in a gzip'd tar, `--format=oldgnu`, sparse (`gcloud compute images create
  --source-uri`'s documented format). Owner, mtime and gzip header are fixed, so it is
  reproducible too.
- Azure: a fixed VHD (`qemu-img convert -O vpc -o subformat=fixed,force_size`): the raw bytes
  then a 512-byte footer. The footer holds a timestamp and a random UUID, so only its raw content
  is reproducible; that is what a verifier compares.

The boot chain and what each step measures: docs/specs/images.md, "Measured boot".
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from umbra.images.oci import file_sha256

if TYPE_CHECKING:
    from umbra.images.verity import VerityTree

MIB = 1 << 20
GIB = 1 << 30
# Fixed GUIDs: the disk carries no random ids (reproducible bytes).
DISK_GUID = "6a2f4c1e-3b7d-4e8a-9c05-1d2e3f405162"
ROOT_PART_GUID = "0fc63daf-8483-4772-8e79-3d69d8477de4"  # GPT partition type: Linux filesystem
ROOT_PART_UUID = "3e1b7a90-5c2d-4f68-8b14-7a9c0d2e6f31"
# The root's dm-verity hash tree (images.verity): the Discoverable Partitions type for an x86-64
# root verity partition.
VERITY_PART_GUID = "2c7357ed-ebd2-46d9-aec1-23d437ec2bf5"
VERITY_PART_UUID = "7d4c2e1a-9b3f-4a60-8e57-1c2b3d4e5f60"
ESP_TYPE_GUID = "c12a7328-f81f-11d2-ba4b-00a0c93ec93b"  # GPT partition type: EFI system
ESP_PART_UUID = "5a3e1b7a-0c4d-4e2f-9a61-3b7c8d9e0f12"
ESP_VOLUME_ID = "5A3E1B7A"
ESP_PATH = "::/EFI/BOOT/BOOTX64.EFI"  # the removable-media boot path for x86-64


class DiskFormatError(Exception):
    pass


@dataclass(frozen=True)
class CloudDisks:
    raw: Path
    raw_sha256: str
    # None when only the raw disk was asked for (QEMU boots it; the clouds' formats are minutes
    # of gzip and a second copy).
    gcp_tar_gz: Path | None
    azure_vhd: Path | None
    verity_root_hash: str  # in the UKI's command line (images.uki)


def _run(
    cmd: list[str], what: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> None:
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise DiskFormatError(f"{what} failed (exit {done.returncode}): {done.stderr.strip()}")


def esp_image(uki: Path, out: Path, epoch: int) -> Path:
    """A FAT32 ESP holding only the UKI, built without mounting. mkfs.fat's --invariant fixes
    its boot-sector and label times, mlabel then sets our volume id; mtools stamps the files and
    directories with SOURCE_DATE_EPOCH."""
    size = -(-(uki.stat().st_size + 16 * MIB) // (64 * MIB)) * 64 * MIB  # >= 64 MiB: FAT32
    env = os.environ | {"SOURCE_DATE_EPOCH": str(epoch), "MTOOLS_SKIP_CHECK": "1", "TZ": "UTC"}
    out.unlink(missing_ok=True)
    _run(["mkfs.vfat", "-C", str(out), str(size // 1024), "-F", "32", "-n", "UMBRA-ESP",
          "--invariant"], "mkfs.vfat (ESP)", env=env)  # fmt: skip
    _run(["mlabel", "-i", str(out), "-N", ESP_VOLUME_ID, "::UMBRA-ESP"], "mlabel (ESP)", env=env)
    _run(["mmd", "-i", str(out), "::/EFI", "::/EFI/BOOT"], "mmd (ESP)", env=env)
    _run(["mcopy", "-i", str(out), str(uki), ESP_PATH], "mcopy (ESP)", env=env)
    return out


def raw_disk(rootfs: Path, esp: Path, out: Path, verity: Path) -> Path:
    size, esp_size, hash_size = rootfs.stat().st_size, esp.stat().st_size, verity.stat().st_size
    for part, n in ((rootfs, size), (esp, esp_size), (verity, hash_size)):
        if n % MIB:
            raise DiskFormatError(f"{part}: {n} bytes is not a whole number of MiB")
    # 1 MiB before the partitions (protective MBR + GPT), 1 MiB after (backup GPT), whole GiB.
    total = -(-(esp_size + size + hash_size + 2 * MIB) // GIB) * GIB
    out.unlink(missing_ok=True)
    with out.open("wb") as f:
        f.truncate(total)
    root_start = 2048 + esp_size // 512
    hash_start = root_start + size // 512
    script = (
        f"label: gpt\nlabel-id: {DISK_GUID}\nunit: sectors\nfirst-lba: 2048\n"
        f"start=2048, size={esp_size // 512}, type={ESP_TYPE_GUID}, uuid={ESP_PART_UUID}, "
        'name="umbra-esp"\n'
        f"start={root_start}, size={size // 512}, type={ROOT_PART_GUID}, uuid={ROOT_PART_UUID}, "
        'name="umbra-root"\n'
        f"start={hash_start}, size={hash_size // 512}, type={VERITY_PART_GUID}, "
        f'uuid={VERITY_PART_UUID}, name="umbra-root-verity"\n'
    )
    _run(["sfdisk", "--quiet", "--no-reread", "--no-tell-kernel", str(out)], "sfdisk", script)
    _copy_sparse(esp, out, MIB)
    _copy_sparse(rootfs, out, root_start * 512)
    _copy_sparse(verity, out, hash_start * 512)
    return out


def _copy_sparse(src: Path, dst: Path, offset: int) -> None:
    """Copy src into dst at offset, skipping all-zero blocks (dst is already zero there)."""
    zero = bytes(MIB)
    with src.open("rb") as fin, dst.open("r+b") as fout:
        pos = 0
        while chunk := fin.read(MIB):
            if chunk != zero[: len(chunk)]:
                fout.seek(offset + pos)
                fout.write(chunk)
            pos += len(chunk)


def gcp_tarball(raw: Path, out: Path, epoch: int) -> Path:
    """`disk.raw` is the only member; GNU tar's oldgnu format with sparse entries."""
    if raw.name != "disk.raw":
        raise DiskFormatError(f"GCP needs the member named disk.raw, got {raw.name}")
    tar = subprocess.Popen(
        ["tar", "--format=oldgnu", "--sparse", "--create", f"--mtime=@{epoch}",
         "--owner=0", "--group=0", "--numeric-owner", "--mode=0644",
         "-C", str(raw.parent), "-f", "-", raw.name],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    with out.open("wb") as f:
        gz = subprocess.run(["gzip", "-n", "-6"], stdin=tar.stdout, stdout=f, check=False)
    assert tar.stdout is not None
    tar.stdout.close()
    err = tar.stderr.read().decode() if tar.stderr else ""
    if tar.wait() != 0 or gz.returncode != 0:
        raise DiskFormatError(f"tar | gzip failed: {err.strip()}")
    return out


def azure_vhd(raw: Path, out: Path) -> Path:
    if raw.stat().st_size % MIB:
        raise DiskFormatError("Azure needs a virtual size that is a multiple of 1 MiB")
    _run(
        ["qemu-img", "convert", "-f", "raw", "-O", "vpc", "-o", "subformat=fixed,force_size",
         str(raw), str(out)],
        "qemu-img convert (fixed VHD)",
    )  # fmt: skip
    return out


def build_cloud_disks(
    rootfs: Path, verity: VerityTree, uki: Path, out: Path, epoch: int, cloud_formats: bool = True
) -> CloudDisks:
    out.mkdir(parents=True, exist_ok=True)
    esp = esp_image(uki, out / "esp.img", epoch)
    raw = raw_disk(rootfs, esp, out / "disk.raw", verity.hash_tree)
    esp.unlink()
    digest = file_sha256(raw)
    tgz = gcp_tarball(raw, out / "umbra-gcp.tar.gz", epoch) if cloud_formats else None
    vhd = azure_vhd(raw, out / "umbra-azure.vhd") if cloud_formats else None
    os.sync()
    return CloudDisks(raw, digest, tgz, vhd, verity.root_hash)
