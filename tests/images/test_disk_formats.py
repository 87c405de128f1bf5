"""The cloud disk formats, packed from the OS image the QEMU boot test boots: GCP's `disk.raw`
in an oldgnu, sparse `.tar.gz`, Azure's fixed VHD (1 MiB aligned), and a raw disk (ESP with the
UKI, then root) whose bytes, and whose UKI's, are the same on every pack of the same OS image."""

from __future__ import annotations

import gzip
import json
import struct
import subprocess
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from umbra.cli.app import app
from umbra.images.disk_formats import (
    ESP_PART_UUID,
    ESP_PATH,
    ESP_TYPE_GUID,
    GIB,
    MIB,
    ROOT_PART_GUID,
    ROOT_PART_UUID,
    VERITY_PART_GUID,
    VERITY_PART_UUID,
    CloudDisks,
    DiskFormatError,
    raw_disk,
)
from umbra.images.os_image import OsImage
from umbra.images.secure_boot import SECURE_BOOT_DB_NAME, secure_boot_db
from umbra.images.uki import Uki, UkiSigner, kernel_cmdline

from .conftest import EPOCH, need_root_and

pytestmark = pytest.mark.timeout(1500)


def test_gcp_and_azure_formats_from_the_os_image(
    qemu_os_image: OsImage,
    qemu_disks: tuple[Uki, CloudDisks],
    sb_signer: UkiSigner,
    tmp_path: Path,
) -> None:
    need_root_and("qemu-img")
    uki, first = qemu_disks
    # The second pack through the CLI the release workflow calls, signed with the same key.
    done = CliRunner().invoke(
        app,
        ["image", "disks", str(qemu_os_image.rootfs.parent), "--out", str(tmp_path / "b"),
         "--source-date-epoch", EPOCH, "--sb-key", str(sb_signer.key),
         "--sb-cert", str(sb_signer.cert), "--json"],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    second = json.loads(done.stdout)
    # The image's Secure Boot db for the clouds: the release certificate, nothing else.
    db = json.loads((tmp_path / "b" / SECURE_BOOT_DB_NAME).read_text())
    assert db["cert_sha256"] == second["secure_boot_cert_sha256"]
    assert db == secure_boot_db(sb_signer.cert).document()
    assert not (tmp_path / "b" / "umbra-uki.unsigned.efi").exists()
    size = first.raw.stat().st_size
    print(f"disk.raw {size >> 20} MiB, sha256 {first.raw_sha256}")
    print(f"UKI sha256 {uki.sha256}, Authenticode sha384 {uki.authenticode_sha384}")
    # Reproducible: the same OS image and key pack to the same signed UKI (signing time = the
    # epoch), raw bytes and tarball.
    assert (uki.sha256, uki.authenticode_sha384) == (
        second["uki_sha256"],
        second["uki_authenticode_sha384"],
    )
    assert second["verity_root_hash"] == first.verity_root_hash
    assert second["cmdline"] == kernel_cmdline(first.verity_root_hash)
    assert first.raw_sha256 == second["raw_sha256"]
    assert first.gcp_tar_gz.read_bytes() == Path(second["gcp"]).read_bytes()
    assert size % GIB == 0
    # The GPT: the ESP (EFI system type) first, the UKI at the removable-media path, then root,
    # then root's dm-verity hash tree.
    table = json.loads(
        subprocess.run(["sfdisk", "--json", str(first.raw)], capture_output=True, check=True).stdout
    )["partitiontable"]["partitions"]
    assert [(p["type"].lower(), p["uuid"].lower()) for p in table] == [
        (ESP_TYPE_GUID, ESP_PART_UUID),
        (ROOT_PART_GUID, ROOT_PART_UUID),
        (VERITY_PART_GUID, VERITY_PART_UUID),
    ]
    esp = tmp_path / "esp.img"
    with first.raw.open("rb") as f, esp.open("wb") as g:
        f.seek(table[0]["start"] * 512)
        g.write(f.read(table[0]["size"] * 512))
    got = subprocess.run(
        ["mtype", "-i", str(esp), ESP_PATH], capture_output=True, check=True
    ).stdout
    assert got == uki.path.read_bytes()
    # GCP: one member, disk.raw, GNU oldgnu headers ("ustar  \0"), stored sparse.
    with gzip.open(first.gcp_tar_gz) as f:
        header = f.read(512)
    assert header[:8] == b"disk.raw" and header[257:265] == b"ustar  \x00"
    with tarfile.open(first.gcp_tar_gz) as tar:
        (member,) = tar.getmembers()
        assert member.name == "disk.raw" and member.size == size and member.issparse()
        assert member.mtime == int(EPOCH) and member.uid == member.gid == 0
    # Azure: a fixed VHD is the raw bytes plus a 512-byte "conectix" footer.
    vhd = first.azure_vhd
    assert vhd.stat().st_size == size + 512
    with vhd.open("rb") as f:
        f.seek(size)
        footer = f.read(512)
        f.seek(0)
        head = f.read(MIB)
    cookie, _feat, _ver, data_offset = struct.unpack(">8sIIQ", footer[:24])
    original, current = struct.unpack(">QQ", footer[40:56])
    (disk_type,) = struct.unpack(">I", footer[60:64])
    assert cookie == b"conectix" and data_offset == 0xFFFFFFFFFFFFFFFF
    assert disk_type == 2  # fixed
    assert original == current == size and current % MIB == 0
    with first.raw.open("rb") as f:
        assert head == f.read(MIB)  # the protective MBR and GPT, unchanged


def test_a_rootfs_not_in_whole_mib_is_refused(tmp_path: Path) -> None:
    odd, esp, tree = tmp_path / "rootfs.ext4", tmp_path / "esp.img", tmp_path / "rootfs.verity"
    odd.write_bytes(b"x" * 1000)
    esp.write_bytes(bytes(MIB))
    tree.write_bytes(bytes(MIB))
    with pytest.raises(DiskFormatError, match="not a whole number of MiB"):
        raw_disk(odd, esp, tmp_path / "disk.raw", tree)


def test_an_os_image_directory_without_its_boot_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "rootfs.ext4").write_bytes(bytes(MIB))
    done = CliRunner().invoke(
        app, ["image", "disks", str(tmp_path), "--out", str(tmp_path / "o"), "--json"]
    )
    assert done.exit_code != 0
    assert "not an OS image directory" in done.output and "vmlinuz" in done.output
