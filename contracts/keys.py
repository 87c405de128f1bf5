"""Key ids: how an Ed25519 public key is named in signed documents (bundles, manifests)."""

from __future__ import annotations

import hashlib

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey


def key_fingerprint(public_key: Ed25519PublicKey) -> str:
    """SHA-256 of the raw public key, hex (image manifests name keys this way)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def key_id(public_key: Ed25519PublicKey) -> str:
    """`ed25519:` and the first 32 hex digits of the fingerprint (policy bundles)."""
    return "ed25519:" + key_fingerprint(public_key)[:32]
