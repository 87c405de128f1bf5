"""The root file system's dm-verity hash tree (images.verity) and the UKI command line that
carries its root hash, from a small ext4 image (no OS image build, no root): reproducible, the
root hash in the command line, any change to the file system changes the root hash and so the
UKI's Authenticode hash (RTMR1), and a build host without veritysetup is refused."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from umbra.images.disk_formats import MIB, DiskFormatError
from umbra.images.uki import VERITY_DEVICE, build_uki, kernel_cmdline
from umbra.images.verity import format_verity

from .test_uki import STUB, _need


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    if shutil.which("veritysetup") is None:
        pytest.skip("needs veritysetup (cryptsetup-bin; scripts/system-deps installs it)")
    if shutil.which("mke2fs") is None:
        pytest.skip("needs mke2fs (e2fsprogs; scripts/system-deps installs it)")
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc/agent.service").write_text("[Service]\nExecStart=/bin/true\n" * 100)
    image = tmp_path / "rootfs.ext4"
    subprocess.run(
        ["mke2fs", "-q", "-t", "ext4", "-U", "0d3c9a52-6b8e-4f5a-9d0b-2f1e0c7b4a11",
         "-E", "hash_seed=0d3c9a52-6b8e-4f5a-9d0b-2f1e0c7b4a11", "-d", str(tree), str(image),
         "8M"],
        check=True, env={"SOURCE_DATE_EPOCH": "1700000000", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )  # fmt: skip
    return image


def _flip(path: Path, needle: bytes) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(needle)
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_hash_tree_is_reproducible_and_changes_with_any_byte(
    rootfs: Path, tmp_path: Path
) -> None:
    a = format_verity(rootfs, tmp_path / "a.verity")
    b = format_verity(rootfs, tmp_path / "b.verity")
    assert a.root_hash == b.root_hash
    assert a.hash_tree.read_bytes() == b.hash_tree.read_bytes()
    assert a.hash_tree.stat().st_size % MIB == 0  # a whole-MiB partition
    _flip(rootfs, b"ExecStart=/bin/true")  # one byte of a file's data block
    c = format_verity(rootfs, tmp_path / "c.verity")
    assert c.root_hash != a.root_hash


def test_the_uki_cmdline_carries_the_root_hash_so_rtmr1_covers_the_rootfs(
    rootfs: Path, tmp_path: Path
) -> None:
    _need("objcopy")
    kernel, initrd = tmp_path / "vmlinuz", tmp_path / "initrd.img"
    kernel.write_bytes(bytes(range(256)) * 4000)
    initrd.write_bytes(b"initrd" * 50000)
    before = format_verity(rootfs, tmp_path / "a.verity")
    uki = build_uki(kernel, initrd, STUB, tmp_path / "a.efi", kernel_cmdline(before.root_hash))
    subprocess.run(
        ["objcopy", "-O", "binary", "--only-section=.cmdline", str(uki.path), str(tmp_path / "c")],
        check=True,
    )
    cmdline = (tmp_path / "c").read_text().split()
    # The root is the verity device only, read-only, checked against this root hash; a failed
    # boot reboots (panic=) instead of opening a shell on the host's serial console.
    assert f"root={VERITY_DEVICE}" in cmdline and "ro" in cmdline and "rw" not in cmdline
    assert f"umbra.verity={before.root_hash}" in cmdline
    assert any(a.startswith("panic=") and a != "panic=0" for a in cmdline)
    assert not any(a.startswith("root=PARTUUID") for a in cmdline)
    _flip(rootfs, b"ExecStart=/bin/true")
    after = format_verity(rootfs, tmp_path / "b.verity")
    changed = build_uki(kernel, initrd, STUB, tmp_path / "b.efi", kernel_cmdline(after.root_hash))
    assert changed.authenticode_sha384 != uki.authenticode_sha384
    assert changed.authenticode_sha256 != uki.authenticode_sha256


def test_a_build_host_without_veritysetup_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "rootfs.ext4"
    data.write_bytes(bytes(MIB))
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    with pytest.raises(DiskFormatError, match=r"veritysetup not found.*cryptsetup-bin"):
        format_verity(data, tmp_path / "h")


def test_a_rootfs_not_in_whole_blocks_is_refused(tmp_path: Path) -> None:
    if shutil.which("veritysetup") is None:
        pytest.skip("needs veritysetup (cryptsetup-bin; scripts/system-deps installs it)")
    data = tmp_path / "rootfs.ext4"
    data.write_bytes(b"x" * 5000)
    with pytest.raises(DiskFormatError, match="not a whole number of 4096-byte blocks"):
        format_verity(data, tmp_path / "h")


def test_a_host_that_rebuilds_the_tree_for_its_edit_is_still_refused(
    rootfs: Path, tmp_path: Path
) -> None:
    """The attacker who edits the rootfs and makes a matching hash tree: the tree is then
    self-consistent, but its root is not the one the UKI's command line (RTMR1) carries.
    `veritysetup verify` checks in userspace what the kernel checks at each read."""
    golden = format_verity(rootfs, tmp_path / "golden.verity")

    def verify(tree: Path, root_hash: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["veritysetup", "verify", str(rootfs), str(tree), root_hash],
            capture_output=True,
            text=True,
        )

    assert verify(golden.hash_tree, golden.root_hash).returncode == 0
    _flip(rootfs, b"ExecStart=/bin/true")
    assert verify(golden.hash_tree, golden.root_hash).returncode != 0  # the naive edit
    forged = format_verity(rootfs, tmp_path / "forged.verity")
    assert verify(forged.hash_tree, forged.root_hash).returncode == 0  # consistent in itself
    refused = verify(forged.hash_tree, golden.root_hash)
    assert refused.returncode != 0, refused.stdout
    assert "Verification of root hash failed" in refused.stderr + refused.stdout
