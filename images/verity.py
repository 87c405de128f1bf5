"""dm-verity for the CVM root file system: `veritysetup format` over `rootfs.ext4` writes the hash
tree (its own GPT partition, images.disk_formats) and gives the root hash, which goes into the
UKI's fixed command line (images.uki). The firmware measures the UKI into RTMR1, so RTMR1 covers
the root hash, and through the hash tree every block of the root file system: the initramfs
opens the root only through dm-verity (images/os/initramfs/local-top), and the kernel checks each
block it reads.

Reproducible: the salt and the hash device's UUID are fixed, the block sizes and the hash
explicit, so the same `rootfs.ext4` gives the same hash tree bytes and root hash.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from umbra.images.disk_formats import MIB, DiskFormatError

BLOCK = 4096  # data and hash blocks: ext4's block size, the kernel's page
HASH = "sha256"
# Fixed, not secret: a salt only keeps one tree's hashes from being precomputed for another.
SALT = "5d1c7a3e9b0f4e62a8d7c1b3e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718"
HASH_UUID = "1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class VerityTree:
    hash_tree: Path  # the hash device's content (superblock + tree), padded to whole MiB
    root_hash: str


def format_verity(data: Path, out: Path) -> VerityTree:
    exe = shutil.which("veritysetup")
    if exe is None:
        raise DiskFormatError(
            "veritysetup not found: the root file system's dm-verity hash tree needs it "
            "(Debian cryptsetup-bin; scripts/system-deps installs it)"
        )
    size = data.stat().st_size
    if size == 0 or size % BLOCK:
        raise DiskFormatError(f"{data}: {size} bytes is not a whole number of {BLOCK}-byte blocks")
    out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="umbra-verity-") as tmp:
        root_hash_file = Path(tmp) / "root-hash"
        done = subprocess.run(
            [exe, "format", "--hash", HASH, "--data-block-size", str(BLOCK),
             "--hash-block-size", str(BLOCK), "--salt", SALT, "--uuid", HASH_UUID,
             "--root-hash-file", str(root_hash_file), str(data), str(out)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise DiskFormatError(
                f"veritysetup format {data} failed (exit {done.returncode}): {done.stderr.strip()}"
            )
        root_hash = root_hash_file.read_text().strip()
    if not _HEX64.match(root_hash):
        raise DiskFormatError(f"veritysetup format {data}: unexpected root hash {root_hash!r}")
    with out.open("r+b") as f:  # a partition is whole MiB; the zeros after the tree are unread
        f.truncate(-(-out.stat().st_size // MIB) * MIB)
    out.chmod(0o644)
    return VerityTree(out, root_hash)
