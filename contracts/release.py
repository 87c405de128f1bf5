"""The attested secret-release protocol shared by the Console (sealing) and the Security CVM
(opening), defined once: what the quote's report_data binds and how the secrets are sealed.

report_data = SHA-512("umbra-secret-release-v1\\0" ‖ nonce ‖ "\\0" ‖ security_cvm_id ‖ "\\0" ‖
public_key); the secrets travel as one HPKE (RFC 9180 base mode) ciphertext to that X25519 key with
info = "umbra-secret-release-v1\\0" ‖ security_cvm_id ‖ "\\0" ‖ nonce.
"""

from __future__ import annotations

import hashlib

from cryptography.hazmat.primitives import hpke
from pydantic import Field

from umbra.contracts.model import Strict
from umbra.contracts.secret_kinds import SecretKind

REPORT_DATA_CONTEXT = b"umbra-secret-release-v1\x00"
HPKE_INFO_CONTEXT = b"umbra-secret-release-v1"
SUITE = hpke.Suite(hpke.KEM.X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_256_GCM)


def expected_report_data(nonce: str, security_cvm_id: str, public_key: bytes) -> bytes:
    return hashlib.sha512(
        REPORT_DATA_CONTEXT
        + nonce.encode()
        + b"\x00"
        + security_cvm_id.encode()
        + b"\x00"
        + public_key
    ).digest()


def hpke_info(security_cvm_id: str, nonce: str) -> bytes:
    return HPKE_INFO_CONTEXT + b"\x00" + security_cvm_id.encode() + b"\x00" + nonce.encode()


class ReleasedSecret(Strict):
    ref: str
    owner: str | None
    hosts: list[str]
    version: int
    # What `value` holds: the secret itself (static) or its kind's JSON document.
    kind: SecretKind = SecretKind.static
    needs_login: bool = False
    value: str = Field(repr=False, description="Base64 of the secret's bytes.")


class ReleaseDocument(Strict):
    """The sealed plaintext."""

    security_cvm_id: str
    nonce: str
    secrets: list[ReleasedSecret]
