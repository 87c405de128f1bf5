"""Signed bundles: only canonical payloads signed by a pinned key are ever accepted."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.policy.helpers import profile
from umbra.contracts.canonical import canonical_json
from umbra.policy.bundle import (
    MAX_BUNDLE_BYTES,
    SIGNING_CONTEXT,
    BundleError,
    payload_document,
    sign_bundle,
    verify_bundle,
)

PROFILES = [
    profile("web", [{"allow": {"hosts": ["example.com"], "methods": ["GET"]}}]),
    profile(
        "api",
        [{"allow": {"hosts": ["api.example.com"]}}],
        inject=[
            {
                "header": "Authorization",
                "format": "Bearer {secret}",
                "secret": "team/bot",
                "hosts": ["api.example.com"],
            }
        ],
    ),
]


@pytest.fixture(scope="module")
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def signed(key: Ed25519PrivateKey) -> bytes:
    return sign_bundle(payload_document(PROFILES, serial=7, source="abc123"), [key])


def envelope_with(signed: bytes, **changes: object) -> bytes:
    envelope = json.loads(signed)
    envelope.update(changes)
    return json.dumps(envelope).encode()


def test_a_signed_bundle_verifies_and_composes(key: Ed25519PrivateKey, signed: bytes) -> None:
    verified = verify_bundle(signed, [key.public_key()])
    assert verified.serial == 7 and verified.payload.source == "abc123"
    assert verified.profile_names() == ["api", "web"]
    assert verified.hash.startswith("sha256:")
    assert verify_bundle(signed, [key.public_key()]).hash == verified.hash
    policy = verified.compose(["web"])
    assert policy.decide("GET", "https", "example.com", 443, "/").allowed
    assert not policy.decide("GET", "https", "api.example.com", 443, "/").allowed


def test_any_flipped_bit_is_refused(key: Ed25519PrivateKey, signed: bytes) -> None:
    for position in range(len(signed)):
        tampered = bytearray(signed)
        tampered[position] ^= 0x01
        with pytest.raises(BundleError):
            verify_bundle(bytes(tampered), [key.public_key()])


def test_a_changed_payload_is_refused_even_when_well_formed(
    key: Ed25519PrivateKey, signed: bytes
) -> None:
    widened = payload_document(
        [*PROFILES, profile("evil", [{"allow": {"hosts": ["evil.com"]}}])], 8, "x"
    )
    forged = envelope_with(signed, payload=base64.b64encode(widened).decode())
    with pytest.raises(BundleError, match="does not verify"):
        verify_bundle(forged, [key.public_key()])


def test_unsigned_and_foreign_signed_bundles_are_refused(
    key: Ed25519PrivateKey, signed: bytes
) -> None:
    with pytest.raises(BundleError, match="unsigned"):
        verify_bundle(envelope_with(signed, signatures=[]), [key.public_key()])
    stranger = Ed25519PrivateKey.generate()
    foreign = sign_bundle(payload_document(PROFILES, 7, None), [stranger])
    with pytest.raises(BundleError, match="not signed by any pinned key"):
        verify_bundle(foreign, [key.public_key()])
    with pytest.raises(BundleError, match="no pinned bundle keys"):
        verify_bundle(signed, [])


def test_one_pinned_signature_among_several_is_enough(key: Ed25519PrivateKey) -> None:
    other = Ed25519PrivateKey.generate()
    both = sign_bundle(payload_document(PROFILES, 1, None), [other, key])
    assert verify_bundle(both, [key.public_key()]).keyid.startswith("ed25519:")


def test_a_signature_without_the_bundle_context_is_refused(
    key: Ed25519PrivateKey, signed: bytes
) -> None:
    payload = base64.b64decode(json.loads(signed)["payload"])
    bare = key.sign(payload)
    assert key.sign(SIGNING_CONTEXT + payload) != bare
    keyid = json.loads(signed)["signatures"][0]["keyid"]
    forged = envelope_with(
        signed, signatures=[{"keyid": keyid, "sig": base64.b64encode(bare).decode()}]
    )
    with pytest.raises(BundleError, match="does not verify"):
        verify_bundle(forged, [key.public_key()])


def test_a_signed_but_invalid_payload_is_refused(key: Ed25519PrivateKey) -> None:
    document = json.loads(payload_document(PROFILES, 1, None))
    document["profiles"][0]["rules"][0]["hosts"] = ["API.Example.com"]
    bad = sign_bundle(canonical_json(document), [key])
    with pytest.raises(BundleError, match="values that are not in canonical form"):
        verify_bundle(bad, [key.public_key()])
    document["profiles"][0]["rules"][0]["hosts"] = ["not a host"]
    with pytest.raises(BundleError, match="not a valid policy bundle"):
        verify_bundle(sign_bundle(canonical_json(document), [key]), [key.public_key()])


def test_a_signed_non_canonical_payload_is_refused(key: Ed25519PrivateKey) -> None:
    pretty = json.dumps(json.loads(payload_document(PROFILES, 1, None)), indent=2).encode()
    with pytest.raises(BundleError, match="canonical"):
        verify_bundle(sign_bundle(pretty, [key]), [key.public_key()])


def test_oversized_and_garbage_input_is_refused(key: Ed25519PrivateKey, signed: bytes) -> None:
    with pytest.raises(BundleError, match="larger than"):
        verify_bundle(b" " * (MAX_BUNDLE_BYTES + 1), [key.public_key()])
    for garbage in (b"", b"null", b"[]", b"{", envelope_with(signed, payload="***")):
        with pytest.raises(BundleError):
            verify_bundle(garbage, [key.public_key()])


def test_composing_unknown_or_conflicting_profiles_raises_bundle_error(
    key: Ed25519PrivateKey, signed: bytes
) -> None:
    verified = verify_bundle(signed, [key.public_key()])
    with pytest.raises(BundleError, match="no profile named missing"):
        verified.compose(["web", "missing"])
