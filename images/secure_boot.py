"""UEFI Secure Boot for the CVM disk: the UKI signed with the release's Secure Boot key, and that
key's certificate as the image's Secure Boot databases, in the shapes GCP and Azure take.

Both clouds turn Secure Boot on for confidential VMs (the VM components set it, the policy pack
requires it on Azure), and their default db holds Microsoft's CAs, which never signed our UKI:
an unsigned UKI does not boot there. Instead of shim + a Microsoft-signed chain, the image
carries its own db (GCP: the image's `shieldedInstanceInitialState`; Azure: the gallery image
version's `securityProfile.uefiSettings`) holding only the release certificate, as PK, KEK and
db. So the firmware runs nothing but a UKI the release key signed, and with the default
Microsoft KEK gone nobody else can append to db at run time.

Signing does not change what the firmware measures: the Authenticode hash (images.pe) skips the
certificate table, so the signed UKI's RTMR1 event equals the unsigned one's (checked here on
every signature). `osslsigncode sign` (Debian) writes the signature: PKCS#7 over that hash with
the release key, its signing time set to SOURCE_DATE_EPOCH (`-time`), so the same UKI and key
give the same signed bytes (RSA PKCS#1 v1.5 is deterministic; `sbsign` stamps the wall clock).
`sbverify` (Debian sbsigntool, a second implementation) then checks it against the certificate.
Private keys never enter the repository; the tests make throwaway ones.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import Encoding

from umbra.contracts.secure_boot import OWNER_GUID, SecureBootDb
from umbra.images.disk_formats import DiskFormatError
from umbra.images.uki import Uki, describe_uki

# UEFI firmware verifies RSA-2048 (PKCS#1 v1.5, SHA-256); OVMF and the clouds' firmware too.
RSA_BITS = 2048
# `umbra image disks --sb-key … --sb-cert …` writes it beside the disks: what the publishing
# step (components.image / stacks) hands each cloud.
SECURE_BOOT_DB_NAME = "secure-boot-db.json"


class SecureBootError(DiskFormatError):
    pass


def _tool(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        raise SecureBootError(
            f"{name} not found: signing the UKI needs Debian osslsigncode and sbsigntool "
            "(scripts/system-deps)"
        )
    return exe


def load_certificate(cert: Path) -> x509.Certificate:
    """The release's Secure Boot certificate (PEM): RSA-2048, as UEFI firmware requires."""
    try:
        data = cert.read_bytes()
        parsed = x509.load_pem_x509_certificate(data)
    except OSError as exc:
        raise SecureBootError(f"{cert}: cannot read: {exc.strerror}") from None
    except ValueError:
        raise SecureBootError(f"{cert}: not a PEM X.509 certificate") from None
    key = parsed.public_key()
    if not isinstance(key, rsa.RSAPublicKey) or key.key_size != RSA_BITS:
        raise SecureBootError(f"{cert}: the Secure Boot key must be RSA-{RSA_BITS}")
    return parsed


def sign_uki(uki: Path, key: Path, cert: Path, out: Path, epoch: int) -> Uki:
    """Sign the UKI with the release key (signing time `epoch`), check the result with
    `sbverify` against the certificate, and check that the Authenticode hashes (the RTMR1
    event) did not change."""
    load_certificate(cert)
    before = describe_uki(uki)
    out.unlink(missing_ok=True)
    done = subprocess.run(
        [_tool("osslsigncode"), "sign", "-certs", str(cert), "-key", str(key), "-h", "sha256",
         "-time", str(epoch), "-in", str(uki), "-out", str(out)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0 or not out.is_file():
        # osslsigncode names the key file, never prints its bytes.
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise SecureBootError(f"osslsigncode sign {uki} failed: {lines[-1] if lines else ''}")
    out.chmod(0o644)
    verify_signature(out, cert)
    after = describe_uki(out)
    if (after.authenticode_sha384, after.authenticode_sha256) != (
        before.authenticode_sha384,
        before.authenticode_sha256,
    ):
        raise SecureBootError(f"{out}: signing changed the Authenticode hash")
    return after


def verify_signature(uki: Path, cert: Path) -> None:
    done = subprocess.run(
        [_tool("sbverify"), "--cert", str(cert), str(uki)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SecureBootError(
            f"{uki}: not signed by {cert}: {(done.stderr or done.stdout).strip()}"
        )


def secure_boot_db(cert: Path) -> SecureBootDb:
    parsed = load_certificate(cert)
    der = parsed.public_bytes(Encoding.DER)
    return SecureBootDb(
        cert_der_b64=base64.b64encode(der).decode(),
        cert_sha256=hashlib.sha256(der).hexdigest(),
        subject=parsed.subject.rfc4514_string(),
    )


# OVMF (Debian ovmf 2022.11): the Secure Boot build needs SMM (q35, smm=on) and pflash; its empty
# variable store gets our PK/KEK/db with virt-firmware's `virt-fw-vars` (a dev dependency: only
# QEMU stand-ins for a cloud's firmware use it).
OVMF_SECBOOT_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.secboot.fd")
OVMF_VARS_TEMPLATE = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")


def ovmf_vars(cert: Path, out: Path, template: Path = OVMF_VARS_TEMPLATE) -> Path:
    """An OVMF variable store with the release certificate as PK, KEK and db and Secure Boot
    on: the same state the clouds' firmware gets from `secure_boot_db`."""
    load_certificate(cert)
    exe = shutil.which("virt-fw-vars") or str(Path(sys.executable).parent / "virt-fw-vars")
    if not Path(exe).is_file():
        raise SecureBootError("virt-fw-vars not found: install virt-firmware (a dev dependency)")
    out.unlink(missing_ok=True)
    done = subprocess.run(
        [exe, "--input", str(template), "--output", str(out),
         "--set-pk", OWNER_GUID, str(cert), "--add-kek", OWNER_GUID, str(cert),
         "--add-db", OWNER_GUID, str(cert), "--secure-boot"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0 or not out.is_file():
        raise SecureBootError(f"virt-fw-vars failed: {(done.stderr or done.stdout).strip()}")
    return out
