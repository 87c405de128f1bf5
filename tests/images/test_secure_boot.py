"""Secure Boot signing of the UKI and the image's Secure Boot db (no OS build, no root: the
host's stub and stand-in payloads, throwaway keys). The boots under OVMF's Secure Boot firmware
are in test_qemu_boot.py."""

from __future__ import annotations

import base64
import hashlib
import shutil
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from typer.testing import CliRunner

from umbra.cli.app import app
from umbra.images.pe import authenticode_digest
from umbra.images.secure_boot import (
    SecureBootError,
    ovmf_vars,
    secure_boot_db,
    sign_uki,
    verify_signature,
)
from umbra.images.uki import build_uki, kernel_cmdline

from .sb_keys import make_signer
from .test_uki import STUB

EPOCH = 1700000000


def _need() -> None:
    if not STUB.exists():
        pytest.skip(f"needs {STUB} (Debian systemd-boot-efi)")
    for cmd in ("objcopy", "osslsigncode", "sbverify"):
        if shutil.which(cmd) is None:
            pytest.skip(f"needs {cmd} (scripts/system-deps installs it)")


@pytest.fixture
def uki(tmp_path: Path) -> Path:
    _need()
    kernel, initrd = tmp_path / "vmlinuz", tmp_path / "initrd.img"
    kernel.write_bytes(bytes(range(256)) * 4000)
    initrd.write_bytes(b"initrd" * 50000)
    return build_uki(kernel, initrd, STUB, tmp_path / "u.efi", kernel_cmdline("ab" * 32)).path


def test_signing_keeps_the_measured_hash_and_is_reproducible(uki: Path, tmp_path: Path) -> None:
    signer = make_signer(tmp_path / "k")
    a = sign_uki(uki, signer.key, signer.cert, tmp_path / "a.efi", EPOCH)
    b = sign_uki(uki, signer.key, signer.cert, tmp_path / "b.efi", EPOCH)
    # The signing time is the epoch, not the clock: the same UKI and key give the same bytes.
    assert a.path.read_bytes() == b.path.read_bytes()
    assert a.path.read_bytes() != uki.read_bytes()
    # The firmware's RTMR1 event (Authenticode hash) skips the signature: unchanged.
    unsigned = uki.read_bytes()
    assert a.authenticode_sha384 == authenticode_digest(unsigned, "sha384")
    assert a.authenticode_sha256 == authenticode_digest(unsigned, "sha256")
    verify_signature(a.path, signer.cert)


def test_an_unsigned_altered_or_foreign_signed_uki_fails_verification(
    uki: Path, tmp_path: Path
) -> None:
    signer, other = make_signer(tmp_path / "k"), make_signer(tmp_path / "o", "someone else")
    with pytest.raises(SecureBootError, match="not signed by"):
        verify_signature(uki, signer.cert)
    signed = sign_uki(uki, signer.key, signer.cert, tmp_path / "s.efi", EPOCH).path
    with pytest.raises(SecureBootError, match="not signed by"):
        verify_signature(signed, other.cert)
    altered = tmp_path / "altered.efi"
    data = bytearray(signed.read_bytes())
    at = data.index(b"panic=10")
    data[at + 6] = ord("9")  # the command line inside the signed UKI: panic=90
    altered.write_bytes(bytes(data))
    with pytest.raises(SecureBootError, match="not signed by"):
        verify_signature(altered, signer.cert)


def test_bad_keys_are_refused_with_the_file_named(uki: Path, tmp_path: Path) -> None:
    signer = make_signer(tmp_path / "k")
    with pytest.raises(SecureBootError, match=r"nope\.crt: cannot read"):
        sign_uki(uki, signer.key, tmp_path / "nope.crt", tmp_path / "x.efi", EPOCH)
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate\n")
    with pytest.raises(SecureBootError, match=r"garbage\.crt: not a PEM X\.509 certificate"):
        sign_uki(uki, signer.key, garbage, tmp_path / "x.efi", EPOCH)
    other = make_signer(tmp_path / "o")
    with pytest.raises(SecureBootError, match=r"osslsigncode sign .* failed|not signed by"):
        sign_uki(uki, other.key, signer.cert, tmp_path / "x.efi", EPOCH)  # key ≠ cert
    assert not (tmp_path / "x.efi").exists() or not _verifies(tmp_path / "x.efi", signer.cert)


def _verifies(path: Path, cert: Path) -> bool:
    try:
        verify_signature(path, cert)
    except SecureBootError:
        return False
    return True


def test_the_db_document_gives_each_cloud_the_release_certificate(tmp_path: Path) -> None:
    signer = make_signer(tmp_path / "k")
    db = secure_boot_db(signer.cert)
    der = x509.load_pem_x509_certificate(signer.cert.read_bytes()).public_bytes(Encoding.DER)
    assert base64.b64decode(db.cert_der_b64) == der
    assert db.cert_sha256 == hashlib.sha256(der).hexdigest()
    gcp = db.gcp_initial_state()
    assert gcp["dbs"] == [{"content": db.cert_der_b64, "fileType": "X509"}]
    assert gcp["pk"] == gcp["dbs"][0] and gcp["keks"] == gcp["dbs"] and gcp["dbxs"] == []
    azure = db.azure_uefi_settings()
    assert azure["signatureTemplateNames"] == ["NoSignatureTemplate"]  # no Microsoft CA in db
    sigs = azure["additionalSignatures"]
    assert sigs["db"] == [{"type": "x509", "value": [db.cert_der_b64]}]
    assert sigs["pk"] == sigs["db"][0] and sigs["kek"] == sigs["db"]


def test_the_ovmf_store_holds_our_certificate_as_pk_kek_and_db(tmp_path: Path) -> None:
    from umbra.images.secure_boot import OVMF_VARS_TEMPLATE

    if not OVMF_VARS_TEMPLATE.exists():
        pytest.skip(f"needs {OVMF_VARS_TEMPLATE} (Debian ovmf)")
    signer = make_signer(tmp_path / "k")
    store = ovmf_vars(signer.cert, tmp_path / "vars.fd")
    assert store.stat().st_size == OVMF_VARS_TEMPLATE.stat().st_size
    der = base64.b64decode(secure_boot_db(signer.cert).cert_der_b64)
    # The DER certificate sits in PK, KEK and db (EFI_SIGNATURE_LISTs of type X509).
    assert store.read_bytes().count(der) == 3


def test_the_disks_cli_refuses_half_a_signer(tmp_path: Path) -> None:
    signer = make_signer(tmp_path / "k")
    done = CliRunner().invoke(
        app, ["image", "disks", str(tmp_path), "--out", str(tmp_path / "o"),
              "--sb-cert", str(signer.cert), "--json"],
    )  # fmt: skip
    assert done.exit_code != 0
    assert "--sb-key and --sb-cert go together" in done.output
