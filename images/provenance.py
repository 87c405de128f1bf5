"""SLSA v1 build provenance for every image build: an in-toto Statement in a DSSE envelope.

The statement's subjects are the built images (name → manifest digest); its predicate names the
source commit, the builder, the build command and every input's digest (each .deb, the wheel, the
locked requirements, the interpreter tree, npm packages). DSSE signs PAE(payloadType, payload)
with Ed25519; keyid is images.signing's key_id (SHA-256 of the raw public key).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import ConfigDict, Field, ValidationError

from umbra.contracts.model import Strict as _Model
from umbra.images.build import BuildResult
from umbra.images.lock_policy import LockPolicy
from umbra.images.signing import key_id
from umbra.sandbox.render import canonical_json

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "https://umbra.dev/image-build/v1"


class ProvenanceError(Exception):
    """A provenance envelope is refused; the message says why."""


class Digest(_Model):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Subject(_Model):
    name: str
    digest: Digest


class ResourceDescriptor(_Model):
    uri: str
    digest: Digest


class BuildDefinition(_Model):
    buildType: str
    externalParameters: dict[str, Any]
    internalParameters: dict[str, Any] = Field(default_factory=dict)
    resolvedDependencies: list[ResourceDescriptor]


class Builder(_Model):
    id: str


class RunDetails(_Model):
    builder: Builder
    metadata: dict[str, Any] = Field(default_factory=dict)


class Predicate(_Model):
    buildDefinition: BuildDefinition
    runDetails: RunDetails


class Statement(_Model):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type_: str = Field(alias="_type")
    subject: list[Subject] = Field(min_length=1)
    predicateType: str
    predicate: Predicate

    def source_commit(self) -> str | None:
        source = self.predicate.buildDefinition.externalParameters.get("source", {})
        commit = source.get("commit") if isinstance(source, dict) else None
        return commit if isinstance(commit, str) else None

    def lock_policy(self) -> str:
        """The package-lock policy the build ran under; provenance from before the field existed
        was strict (images.lock_policy)."""
        policy = self.predicate.buildDefinition.internalParameters.get("lock_policy")
        return policy if isinstance(policy, str) else str(LockPolicy.STRICT)

    def subjects(self) -> dict[str, str]:
        return {s.name: "sha256:" + s.digest.sha256 for s in self.subject}


def statement(
    result: BuildResult,
    *,
    source_repo: str,
    source_commit: str,
    builder_id: str,
    command: Sequence[str],
) -> Statement:
    return Statement.model_validate(
        {
            "_type": STATEMENT_TYPE,
            "subject": [
                {"name": f"umbra/{i.name}", "digest": {"sha256": i.manifest_digest[7:]}}
                for i in result.images
            ],
            "predicateType": PREDICATE_TYPE,
            "predicate": {
                "buildDefinition": {
                    "buildType": BUILD_TYPE,
                    "externalParameters": {
                        "source": {"repository": source_repo, "commit": source_commit},
                        "rootfs": str(result.rootfs),
                        "command": list(command),
                        "source_date_epoch": result.epoch,
                    },
                    "internalParameters": {
                        "config_digests": {
                            f"umbra/{i.name}": i.config_digest for i in result.images
                        },
                        "layer_digest": result.images[0].layer_digest if result.images else None,
                        # Which versions the image really holds when the lock policy let the
                        # mirror's updates in (images.lock_policy); a release build is strict.
                        "lock_policy": str(result.lock_policy),
                        "lock_drift": [asdict(d) for d in result.lock_drift],
                    },
                    "resolvedDependencies": [
                        {"uri": d.uri, "digest": {"sha256": d.sha256}} for d in result.inputs
                    ],
                },
                "runDetails": {"builder": {"id": builder_id}},
            },
        }
    )


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE pre-authentication encoding."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def sign_statement(st: Statement, key: Ed25519PrivateKey) -> str:
    payload = canonical_json(st.model_dump(mode="json", by_alias=True)).encode()
    envelope = {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode(),
        "signatures": [
            {
                "keyid": key_id(key.public_key()),
                "sig": base64.b64encode(key.sign(pae(PAYLOAD_TYPE, payload))).decode(),
            }
        ],
    }
    return canonical_json(envelope) + "\n"


def verify_envelope(text: str | bytes, keys: Sequence[Ed25519PublicKey]) -> Statement:
    """The statement, if one pinned key signed exactly these payload bytes; else refused."""
    try:
        env: Any = json.loads(text)
        if env.get("payloadType") != PAYLOAD_TYPE:
            raise ProvenanceError(f"payloadType is not {PAYLOAD_TYPE}")
        payload = base64.b64decode(env["payload"], validate=True)
        sigs = [
            (str(s["keyid"]), base64.b64decode(s["sig"], validate=True)) for s in env["signatures"]
        ]
    except ProvenanceError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
        raise ProvenanceError("provenance envelope is malformed") from None
    if not sigs:
        raise ProvenanceError("provenance is unsigned")
    pinned = {key_id(k): k for k in keys}
    for kid, sig in sigs:
        key = pinned.get(kid)
        if key is None:
            continue
        try:
            key.verify(sig, pae(PAYLOAD_TYPE, payload))
        except InvalidSignature:
            raise ProvenanceError("signature does not verify: the provenance was altered") from None
        break
    else:
        raise ProvenanceError("provenance is not signed by any pinned key")
    try:
        st = Statement.model_validate(json.loads(payload))
    except (ValueError, ValidationError) as exc:
        raise ProvenanceError(f"provenance statement does not validate: {exc}") from None
    if st.type_ != STATEMENT_TYPE or st.predicateType != PREDICATE_TYPE:
        raise ProvenanceError("not an in-toto v1 statement with a SLSA v1 provenance predicate")
    return st


def verify_release_images(
    images: dict[str, str],
    envelopes: Sequence[str | bytes],
    keys: Sequence[Ed25519PublicKey],
    expected_commit: str,
) -> dict[str, Statement]:
    """Every `name → sha256:digest` a release names must be a subject (by digest) of signed
    provenance built from `expected_commit`. Returns the statement that covers each image."""
    statements = [verify_envelope(e, keys) for e in envelopes]
    covered: dict[str, Statement] = {}
    for name, digest in sorted(images.items()):
        match = next((s for s in statements if digest in s.subjects().values()), None)
        if match is None:
            raise ProvenanceError(f"{name}@{digest}: no signed provenance names this digest")
        if match.source_commit() != expected_commit:
            raise ProvenanceError(
                f"{name}: built from commit {match.source_commit()}, expected {expected_commit}"
            )
        # A test build may take the mirror's security updates past the lock; a release may not
        # name what such a build produced (its packages are not the reviewed lock's).
        if match.lock_policy() != LockPolicy.STRICT:
            raise ProvenanceError(
                f"{name}: built under lock policy {match.lock_policy()!r}; a release needs "
                f"a {LockPolicy.STRICT.value!r} build (umbra image build without --lock-policy)"
            )
        covered[name] = match
    return covered


def provenance_index(envelopes: Sequence[bytes]) -> dict[str, str]:
    """image digest → SHA-256 of the envelope naming it, for the manifest. Not a verification:
    `umbra image verify` checks the signatures against pinned keys."""
    out: dict[str, str] = {}
    for raw in envelopes:
        try:
            payload = json.loads(base64.b64decode(json.loads(raw)["payload"], validate=True))
            st = Statement.model_validate(payload)
        except (ValueError, KeyError, TypeError, ValidationError, binascii.Error):
            raise ProvenanceError("provenance envelope is malformed") from None
        for digest in st.subjects().values():
            out[digest] = hashlib.sha256(raw).hexdigest()
    return out
