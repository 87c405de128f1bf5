"""Envelope encryption for secrets: a fresh AES-256-GCM data key per secret version, wrapped by a
key encryption key (KEK) that comes from configuration or a KMS and never enters the database.

Both layers bind associated data naming the secret, so a ciphertext moved to another row (or a
wrapped key moved to another secret) fails to decrypt instead of yielding someone else's value.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE_BYTES = 12
_DEK_CONTEXT = b"umbra-console-dek-v1\x00"
_VALUE_CONTEXT = b"umbra-console-secret-v1\x00"


class EnvelopeError(Exception):
    """Sealing or opening failed; never carries key or plaintext material."""


class KeyEncryptionKeys(Protocol):
    """A KEK provider: the local keyring below, or a KMS adapter with the same two calls."""

    @property
    def current_id(self) -> str: ...

    def wrap(self, data_key: bytes, aad: bytes) -> tuple[str, bytes]: ...

    def unwrap(self, kek_id: str, wrapped: bytes, aad: bytes) -> bytes: ...


class LocalKeyring:
    """KEKs held in process memory, loaded from configuration (`UMBRA_CONSOLE_KEK[_FILE]`)."""

    def __init__(self, keys: dict[str, bytes], current: str) -> None:
        if current not in keys:
            raise EnvelopeError(f"kek_current: no key with id {current!r}")
        for key_id, key in keys.items():
            if len(key) != 32:
                raise EnvelopeError(f"kek {key_id!r}: must be 32 bytes")
        self._keys = dict(keys)
        self._current = current

    @classmethod
    def from_config(cls, encoded: dict[str, str], current: str | None) -> LocalKeyring:
        keys = {key_id: base64.b64decode(value) for key_id, value in encoded.items()}
        if current is None:
            if len(keys) != 1:
                raise EnvelopeError("kek_current: must be set when more than one KEK is configured")
            current = next(iter(keys))
        return cls(keys, current)

    @property
    def current_id(self) -> str:
        return self._current

    def wrap(self, data_key: bytes, aad: bytes) -> tuple[str, bytes]:
        nonce = os.urandom(NONCE_BYTES)
        sealed = AESGCM(self._keys[self._current]).encrypt(
            nonce, data_key, _DEK_CONTEXT + self._current.encode() + b"\x00" + aad
        )
        return self._current, nonce + sealed

    def unwrap(self, kek_id: str, wrapped: bytes, aad: bytes) -> bytes:
        key = self._keys.get(kek_id)
        if key is None:
            raise EnvelopeError(f"data key is wrapped by unknown KEK {kek_id!r}")
        try:
            return AESGCM(key).decrypt(
                wrapped[:NONCE_BYTES],
                wrapped[NONCE_BYTES:],
                _DEK_CONTEXT + kek_id.encode() + b"\x00" + aad,
            )
        except InvalidTag:
            raise EnvelopeError("data key does not unwrap (wrong KEK or tampered row)") from None


@dataclass(frozen=True)
class Sealed:
    kek_id: str
    wrapped_key: bytes
    ciphertext: bytes


def seal(keys: KeyEncryptionKeys, plaintext: bytes, aad: bytes) -> Sealed:
    data_key = AESGCM.generate_key(bit_length=256)
    nonce = os.urandom(NONCE_BYTES)
    ciphertext = nonce + AESGCM(data_key).encrypt(nonce, plaintext, _VALUE_CONTEXT + aad)
    kek_id, wrapped = keys.wrap(data_key, aad)
    return Sealed(kek_id=kek_id, wrapped_key=wrapped, ciphertext=ciphertext)


def open_sealed(keys: KeyEncryptionKeys, sealed: Sealed, aad: bytes) -> bytes:
    data_key = keys.unwrap(sealed.kek_id, sealed.wrapped_key, aad)
    try:
        return AESGCM(data_key).decrypt(
            sealed.ciphertext[:NONCE_BYTES], sealed.ciphertext[NONCE_BYTES:], _VALUE_CONTEXT + aad
        )
    except InvalidTag:
        raise EnvelopeError("secret does not decrypt (tampered row)") from None


def secret_aad(team: str, scope: str, owner: str, name: str, version: int) -> bytes:
    return "\x00".join([team, scope, owner, name, str(version)]).encode()
