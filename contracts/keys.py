"""Ed25519 signing keys: how a public key is named in signed documents (bundles, manifests),
and the one way to write and load key files (PKCS#8 / SubjectPublicKeyInfo PEM)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


class KeyFileError(ValueError):
    """A key file cannot be used; the message names the file and why (never key bytes)."""


def key_fingerprint(public_key: Ed25519PublicKey) -> str:
    """SHA-256 of the raw public key, hex (image manifests name keys this way)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def key_id(public_key: Ed25519PublicKey) -> str:
    """`ed25519:` and the first 32 hex digits of the fingerprint (policy bundles)."""
    return "ed25519:" + key_fingerprint(public_key)[:32]


def write_key_pair(key: Ed25519PrivateKey, private_path: Path) -> Path:
    """Write the private key (PKCS#8 PEM, created 0600, never over an existing file) and its
    public key beside it as `<name>.pub`; return the public key's path."""
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    private_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{private_path} exists; refusing to overwrite a key") from None
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    public_path = private_path.with_name(private_path.name + ".pub")
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return public_path


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise KeyFileError(f"{path}: cannot load private key ({type(exc).__name__})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: not an Ed25519 private key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{path}: cannot load public key ({type(exc).__name__})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{path}: not an Ed25519 public key")
    return key
