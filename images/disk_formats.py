"""Cloud disk formats from the OS image's root file system (`rootfs.ext4`, images.os_image).

- `disk.raw`: a GPT disk whose one partition (1 MiB aligned, fixed GUIDs) holds the root file
  system, its size rounded up to whole GiB (GCP wants whole-GiB disks; Azure 1 MiB multiples).
  The same `rootfs.ext4` gives the same bytes: the GPT's disk and partition GUIDs are fixed here,
  and the copy keeps holes (the result is sparse).
- GCP: `disk.raw` in a gzip'd tar, `--format=oldgnu`, sparse (`gcloud compute images create
  --source-uri`'s documented format). Owner, mtime and gzip header are fixed, so it is
  reproducible too.
- Azure: a fixed VHD (`qemu-img convert -O vpc -o subformat=fixed,force_size`): the raw bytes
  then a 512-byte footer. The footer holds a timestamp and a random UUID, so only its raw content
  is reproducible; that is what a verifier compares.

Not a bootable cloud disk yet: there is no ESP/UKI (the QEMU boot uses direct kernel boot), so
RTMR1/2 golden values cannot be computed from these disks. See docs/specs/images.md.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
GIB = 1 << 30
# Fixed GUIDs: the disk carries no random ids (reproducible bytes).
DISK_GUID = "6a2f4c1e-3b7d-4e8a-9c05-1d2e3f405162"
ROOT_PART_GUID = "0fc63daf-8483-4772-8e79-3d69d8477de4"  # GPT partition type: Linux filesystem
ROOT_PART_UUID = "3e1b7a90-5c2d-4f68-8b14-7a9c0d2e6f31"


class DiskFormatError(Exception):
    pass


@dataclass(frozen=True)
class CloudDisks:
    raw: Path
    raw_sha256: str
    gcp_tar_gz: Path
    azure_vhd: Path


def _run(cmd: list[str], what: str, stdin: str | None = None) -> None:
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise DiskFormatError(f"{what} failed (exit {done.returncode}): {done.stderr.strip()}")


def raw_disk(rootfs: Path, out: Path) -> Path:
    size = rootfs.stat().st_size
    if size % MIB:
        raise DiskFormatError(f"{rootfs}: {size} bytes is not a whole number of MiB")
    # 1 MiB before the partition (protective MBR + GPT), 1 MiB after (backup GPT), whole GiB.
    total = -(-(size + 2 * MIB) // GIB) * GIB
    out.unlink(missing_ok=True)
    with out.open("wb") as f:
        f.truncate(total)
    script = (
        f"label: gpt\nlabel-id: {DISK_GUID}\nunit: sectors\nfirst-lba: 2048\n"
        f"start=2048, size={size // 512}, type={ROOT_PART_GUID}, uuid={ROOT_PART_UUID}, "
        'name="umbra-root"\n'
    )
    _run(["sfdisk", "--quiet", "--no-reread", "--no-tell-kernel", str(out)], "sfdisk", script)
    _copy_sparse(rootfs, out, MIB)
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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(4 * MIB):
            h.update(chunk)
    return h.hexdigest()


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


def build_cloud_disks(rootfs: Path, out: Path, epoch: int) -> CloudDisks:
    out.mkdir(parents=True, exist_ok=True)
    raw = raw_disk(rootfs, out / "disk.raw")
    digest = sha256_file(raw)
    tgz = gcp_tarball(raw, out / "umbra-gcp.tar.gz", epoch)
    vhd = azure_vhd(raw, out / "umbra-azure.vhd")
    os.sync()
    return CloudDisks(raw, digest, tgz, vhd)
