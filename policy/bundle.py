"""Signed policy bundles: the compiled profiles of one reviewed revision, signed with Ed25519.

A Security CVM enforces only bundles signed by a key pinned in its measured image, so whoever
delivers the bundle (the Console, the network) cannot widen egress beyond what reviewed policy says.
The signature covers the exact canonical payload bytes, with a domain-separation prefix so that a
signature made for anything else never verifies as a bundle.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Self

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import Field, ValidationError, model_validator

from umbra.contracts import keys
from umbra.contracts.canonical import canonical_json
from umbra.contracts.keys import key_id
from umbra.contracts.validation import first_problem
from umbra.policy.compiled import CompiledProfile
from umbra.policy.compose import CompositionError, EffectivePolicy
from umbra.policy.model import StrictModel

SIGNING_CONTEXT = b"umbra-policy-bundle-v1\x00"
MAX_BUNDLE_BYTES = 16 << 20


class BundleError(Exception):
    """A bundle that must not be enforced: malformed, unsigned, or signed by no pinned key."""


class BundlePayload(StrictModel):
    api_version: Literal["umbra/v1"] = Field(alias="apiVersion")
    kind: Literal["PolicyBundle"]
    serial: int = Field(
        ge=0, description="Increases with every release; proxies refuse older serials."
    )
    source: str | None = Field(
        default=None, description="Where it was built from, e.g. a git revision."
    )
    profiles: list[CompiledProfile]

    @model_validator(mode="after")
    def _unique_names(self) -> Self:
        names = [profile.name for profile in self.profiles]
        if len(names) != len(set(names)):
            raise ValueError("profile names must be unique")
        return self


class BundleSignature(StrictModel):
    keyid: str
    sig: str


class SignedBundle(StrictModel):
    api_version: Literal["umbra/v1"] = Field(alias="apiVersion")
    kind: Literal["SignedPolicyBundle"]
    payload: str = Field(description="Base64 of the canonical JSON payload.")
    signatures: list[BundleSignature]


@dataclass(frozen=True)
class VerifiedBundle:
    payload: BundlePayload
    hash: str
    keyid: str

    @property
    def serial(self) -> int:
        return self.payload.serial

    def profile_names(self) -> list[str]:
        return sorted(profile.name for profile in self.payload.profiles)

    def compose(self, names: Iterable[str]) -> EffectivePolicy:
        """The effective policy for a sandbox with these profiles attached."""
        by_name = {profile.name: profile for profile in self.payload.profiles}
        wanted = sorted(set(names))
        missing = [name for name in wanted if name not in by_name]
        if missing:
            raise BundleError(f"bundle {self.hash} has no profile named {', '.join(missing)}")
        try:
            return EffectivePolicy([by_name[name] for name in wanted])
        except CompositionError as exc:
            raise BundleError(f"profiles {wanted} do not compose: {exc}") from None


def payload_document(profiles: Sequence[CompiledProfile], serial: int, source: str | None) -> bytes:
    payload = BundlePayload(
        api_version="umbra/v1",
        kind="PolicyBundle",
        serial=serial,
        source=source,
        profiles=sorted(profiles, key=lambda profile: profile.name),
    )
    return canonical_json(payload.model_dump(mode="json", by_alias=True))


def sign_bundle(payload: bytes, keys: Sequence[Ed25519PrivateKey]) -> bytes:
    """Wrap canonical payload bytes in a signed envelope (JSON)."""
    if not keys:
        raise BundleError("a bundle needs at least one signing key")
    envelope = {
        "apiVersion": "umbra/v1",
        "kind": "SignedPolicyBundle",
        "payload": base64.b64encode(payload).decode(),
        "signatures": [
            {
                "keyid": key_id(key.public_key()),
                "sig": base64.b64encode(key.sign(SIGNING_CONTEXT + payload)).decode(),
            }
            for key in keys
        ],
    }
    return canonical_json(envelope)


def verify_bundle(raw: bytes, trusted_keys: Sequence[Ed25519PublicKey]) -> VerifiedBundle:
    """Verify a signed bundle against pinned keys and parse its payload; raise BundleError otherwise."""
    if not trusted_keys:
        raise BundleError("no pinned bundle keys are configured, so no bundle can be trusted")
    if len(raw) > MAX_BUNDLE_BYTES:
        raise BundleError(f"bundle is larger than {MAX_BUNDLE_BYTES} bytes")
    try:
        envelope = SignedBundle.model_validate_json(raw)
    except ValidationError as exc:
        raise BundleError(f"not a signed bundle: {_first_error(exc)}") from None
    try:
        payload = base64.b64decode(envelope.payload, validate=True)
    except binascii.Error:
        raise BundleError("bundle payload is not valid base64") from None
    # The decoder ignores the unused low bits of the last character: one payload, one spelling.
    if base64.b64encode(payload).decode() != envelope.payload:
        raise BundleError("bundle payload is not canonical base64")
    trusted = {key_id(key): key for key in trusted_keys}
    signer = _find_valid_signature(envelope.signatures, trusted, payload)
    try:
        document = json.loads(payload)
        parsed = BundlePayload.model_validate(document)
    except (ValueError, ValidationError) as exc:
        detail = _first_error(exc) if isinstance(exc, ValidationError) else str(exc)
        raise BundleError(f"signed payload is not a valid policy bundle: {detail}") from None
    if canonical_json(document) != payload:
        raise BundleError("signed payload is not in canonical form")
    # Validators normalize as they parse; a payload that changes under them was not built by us.
    if canonical_json(parsed.model_dump(mode="json", by_alias=True)) != payload:
        raise BundleError("signed payload holds values that are not in canonical form")
    return VerifiedBundle(
        payload=parsed, hash="sha256:" + hashlib.sha256(payload).hexdigest(), keyid=signer
    )


def _find_valid_signature(
    signatures: Sequence[BundleSignature], trusted: dict[str, Ed25519PublicKey], payload: bytes
) -> str:
    if not signatures:
        raise BundleError("bundle is unsigned")
    for signature in signatures:
        key = trusted.get(signature.keyid)
        if key is None:
            continue
        try:
            sig = base64.b64decode(signature.sig, validate=True)
            if base64.b64encode(sig).decode() != signature.sig:
                raise InvalidSignature("not canonical base64")
            key.verify(sig, SIGNING_CONTEXT + payload)
        except (InvalidSignature, binascii.Error):
            raise BundleError(
                f"signature by pinned key {signature.keyid} does not verify"
            ) from None
        return signature.keyid
    raise BundleError("bundle is not signed by any pinned key")


def _first_error(exc: ValidationError) -> str:
    return first_problem(exc)


def generate_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        return keys.load_private_key(path)
    except keys.KeyFileError as exc:
        raise BundleError(f"signing key: {exc}") from None


def load_public_key(path: Path) -> Ed25519PublicKey:
    try:
        return keys.load_public_key(path)
    except keys.KeyFileError as exc:
        raise BundleError(f"public key: {exc}") from None
