"""Attested secret release: secrets leave the Console only HPKE-encrypted to a key that an attested
Security CVM bound into its TDX quote.

The Security CVM asks for a single-use nonce, generates an X25519 key pair inside the TD, and puts
`SHA-512("umbra-secret-release-v1\\0" ‖ nonce ‖ security_cvm_id ‖ public_key)` in the quote's
report_data. A `SecretReleaseVerifier` checks the quote (DCAP, measurement policy, event log) and the
binding, and returns the public key; the Console then seals the release document to that key with
HPKE base mode (RFC 9180: DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-256-GCM) using
`cryptography.hazmat.primitives.hpke`.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from pydantic import Field

from umbra.attest.errors import AttestError
from umbra.attest.eventlog import load_event_log
from umbra.attest.verify import Verifier
from umbra.contracts.model import Strict
from umbra.contracts.release import SUITE, expected_report_data, hpke_info

__all__ = ["SUITE", "expected_report_data", "hpke_info"]


class ReleaseRefused(Exception):
    """The evidence does not entitle anyone to secrets; the message says which check failed."""


class ReleaseEvidence(Strict):
    nonce: str = Field(pattern=r"^[A-Za-z0-9_-]{16,64}$", description="From release-challenge.")
    quote: str = Field(max_length=64 << 10, description="Base64 TDX quote.")
    event_log: str | None = Field(
        default=None, max_length=1 << 20, description="Base64 event log (dstack JSON or CCEL)."
    )
    public_key: str = Field(max_length=64, description="Base64 raw X25519 public key (32 bytes).")


def decode_b64(value: str, what: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error:
        raise ReleaseRefused(f"{what} is not valid base64") from None


def public_key_bytes(evidence: ReleaseEvidence) -> bytes:
    raw = decode_b64(evidence.public_key, "public_key")
    if len(raw) != 32:
        raise ReleaseRefused("public_key must be a raw 32-byte X25519 key")
    return raw


class SecretReleaseVerifier(Protocol):
    """Decides whether evidence comes from a genuine Security CVM; returns the key bound in it."""

    def verify(self, evidence: ReleaseEvidence, security_cvm_id: str) -> X25519PublicKey: ...


@dataclass
class AttestedReleaseVerifier:
    """`SecretReleaseVerifier` on `umbra.attest`: full quote verification against the Security CVM
    image's measurement policy, with report_data required to bind nonce, CVM id and key."""

    verifier: Verifier

    def verify(self, evidence: ReleaseEvidence, security_cvm_id: str) -> X25519PublicKey:
        key = public_key_bytes(evidence)
        quote = decode_b64(evidence.quote, "quote")
        events = None
        if evidence.event_log is not None:
            try:
                events = load_event_log(decode_b64(evidence.event_log, "event_log"))
            except (AttestError, ValueError) as exc:
                raise ReleaseRefused(f"event_log does not parse: {exc}") from None
        verdict = self.verifier.verify(
            quote,
            event_log=events,
            expected_report_data=expected_report_data(evidence.nonce, security_cvm_id, key),
        )
        if not verdict.ok:
            raise ReleaseRefused("attestation failed: " + "; ".join(verdict.reasons))
        return X25519PublicKey.from_public_bytes(key)


def seal_release(document: bytes, recipient: X25519PublicKey, info: bytes) -> bytes:
    """HPKE single-shot seal: `enc (32 bytes) ‖ ciphertext`."""
    return SUITE.encrypt(document, recipient, info=info)


def describe_suite() -> Sequence[str]:
    return ("DHKEM(X25519, HKDF-SHA256)", "HKDF-SHA256", "AES-256-GCM")
