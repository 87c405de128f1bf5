"""Ed25519 signatures over measurement manifests.

signature = Ed25519(DOMAIN ‖ canonical JSON of the manifest); the signed document carries the
manifest as an object plus `key_id` (SHA-256 of the raw public key). Verification recomputes
the canonical bytes from the received object and accepts only pinned keys.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import ValidationError

from umbra.contracts import keys
from umbra.contracts.keys import key_fingerprint
from umbra.images.manifest import MeasurementManifest
from umbra.sandbox.render import canonical_json

DOMAIN = b"umbra-measurement-manifest-v1\0"


class SignatureError(Exception):
    """A signed manifest is not acceptable; the message says why."""


def key_id(public: Ed25519PublicKey) -> str:
    """Manifests name their signing key by `contracts.keys.key_fingerprint`."""
    return key_fingerprint(public)


def sign_manifest(manifest: MeasurementManifest, key: Ed25519PrivateKey) -> str:
    sig = key.sign(DOMAIN + manifest.canonical())
    doc = {
        "apiVersion": "umbra/v1",
        "kind": "SignedMeasurementManifest",
        "key_id": key_id(key.public_key()),
        "manifest": json.loads(manifest.canonical()),
        "signature": base64.b64encode(sig).decode(),
    }
    return canonical_json(doc) + "\n"


def verify_signed_manifest(
    text: str | bytes, keys: Sequence[Ed25519PublicKey]
) -> MeasurementManifest:
    try:
        doc: Any = json.loads(text)
        if doc.get("kind") != "SignedMeasurementManifest" or doc.get("apiVersion") != "umbra/v1":
            raise SignatureError("not an umbra/v1 SignedMeasurementManifest")
        body, kid = doc["manifest"], str(doc["key_id"])
        sig = base64.b64decode(doc["signature"], validate=True)
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
        raise SignatureError("signed manifest is malformed") from None
    key = next((k for k in keys if key_id(k) == kid), None)
    if key is None:
        raise SignatureError(f"signed by key {kid[:16]}…, which is not pinned")
    try:
        key.verify(sig, DOMAIN + canonical_json(body).encode())
    except InvalidSignature:
        raise SignatureError("signature does not verify: the manifest was altered") from None
    try:
        manifest = MeasurementManifest.model_validate(body)
    except ValidationError as exc:
        raise SignatureError(f"signed manifest does not validate: {exc}") from None
    if manifest.canonical() != canonical_json(body).encode():
        raise SignatureError("signed manifest is not in canonical form")
    return manifest


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        return keys.load_private_key(path)
    except keys.KeyFileError as exc:
        raise SignatureError(str(exc)) from None


def load_public_key(path: Path) -> Ed25519PublicKey:
    try:
        return keys.load_public_key(path)
    except keys.KeyFileError as exc:
        raise SignatureError(str(exc)) from None
