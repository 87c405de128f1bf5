"""SLSA v1 provenance in DSSE: sign, verify, and refuse tampered, unsigned or foreign envelopes;
the release manifest names each image's provenance and `umbra image verify` checks the chain."""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from umbra.cli.app import app
from umbra.images.build import BuildResult, Input
from umbra.images.lock_policy import LockPolicy
from umbra.images.oci import BuiltImage
from umbra.images.provenance import (
    ProvenanceError,
    sign_statement,
    statement,
    verify_envelope,
    verify_release_images,
)
from umbra.images.recipes import Rootfs

from ..sandbox.fixtures import digest_ref, security_definition_doc

COMMIT = "0123456789abcdef0123456789abcdef01234567"
runner = CliRunner()


def _digest(name: str) -> str:
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


def _result(*names: str) -> BuildResult:
    images = [
        BuiltImage(n, _digest("cfg" + n), _digest(n), _digest("layer"), Path(f"{n}.docker.tar"))
        for n in names
    ]
    inputs = [Input("pkg:deb/debian/libc6_2.36.deb", "ab" * 32), Input("file:umbra.whl", "cd" * 32)]
    return BuildResult(Rootfs.RUNTIME, 1700000000, images, inputs)


def _envelope(key: Ed25519PrivateKey, *names: str, commit: str = COMMIT) -> str:
    st = statement(
        _result(*names),
        source_repo="umbra",
        source_commit=commit,
        builder_id="test",
        command=["umbra", "image", "build", "runtime"],
    )
    return sign_statement(st, key)


def test_signed_provenance_verifies_and_names_every_input() -> None:
    key = Ed25519PrivateKey.generate()
    st = verify_envelope(_envelope(key, "forwarder", "sshd"), [key.public_key()])
    assert st.source_commit() == COMMIT
    assert st.subjects() == {"umbra/forwarder": _digest("forwarder"), "umbra/sshd": _digest("sshd")}
    deps = st.predicate.buildDefinition.resolvedDependencies
    assert [d.uri for d in deps] == ["pkg:deb/debian/libc6_2.36.deb", "file:umbra.whl"]


def test_tampered_unsigned_and_foreign_provenance_is_refused() -> None:
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    env = json.loads(_envelope(key, "forwarder"))
    payload = json.loads(base64.b64decode(env["payload"]))
    payload["subject"][0]["digest"]["sha256"] = "00" * 32
    tampered = env | {"payload": base64.b64encode(json.dumps(payload).encode()).decode()}
    with pytest.raises(ProvenanceError, match="altered"):
        verify_envelope(json.dumps(tampered), [key.public_key()])
    with pytest.raises(ProvenanceError, match="unsigned"):
        verify_envelope(json.dumps(env | {"signatures": []}), [key.public_key()])
    with pytest.raises(ProvenanceError, match="not signed by any pinned key"):
        verify_envelope(json.dumps(env), [other.public_key()])
    with pytest.raises(ProvenanceError, match="malformed"):
        verify_envelope("{not json", [key.public_key()])


def test_release_images_need_provenance_from_the_expected_commit() -> None:
    key = Ed25519PrivateKey.generate()
    envs = [_envelope(key, "forwarder")]
    images = {"forwarder": _digest("forwarder")}
    assert set(verify_release_images(images, envs, [key.public_key()], COMMIT)) == {"forwarder"}
    with pytest.raises(ProvenanceError, match="expected"):
        verify_release_images(images, envs, [key.public_key()], "f" * 40)
    with pytest.raises(ProvenanceError, match="no signed provenance"):
        verify_release_images({"sshd": _digest("sshd")}, envs, [key.public_key()], COMMIT)


def test_release_images_refuse_a_build_that_took_lock_drift() -> None:
    key = Ed25519PrivateKey.generate()
    result = replace(_result("forwarder"), lock_policy=LockPolicy.SECURITY_UPDATES)
    st = statement(
        result, source_repo="umbra", source_commit=COMMIT, builder_id="test", command=["umbra"]
    )
    envs = [sign_statement(st, key)]
    with pytest.raises(ProvenanceError, match="lock policy 'security-updates'"):
        verify_release_images({"forwarder": _digest("forwarder")}, envs, [key.public_key()], COMMIT)


def _write_key(path: Path, key: Ed25519PrivateKey) -> Path:
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.write_bytes(pem)
    pub = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    Path(f"{path}.pub").write_bytes(pub)
    return path


def test_cli_release_manifest_names_provenance_and_verify_checks_it(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    key_file = _write_key(tmp_path / "release.key", key)
    # Provenance whose subjects are exactly the digests the definition's compose pins.
    refs = {n: digest_ref(n).rsplit("@", 1)[1] for n in ("proxy",)}
    st = statement(
        BuildResult(
            Rootfs.RUNTIME,
            1700000000,
            [BuiltImage(n, _digest("c" + n), d, _digest("l"), Path("x")) for n, d in refs.items()],
            [Input("file:umbra.whl", "cd" * 32)],
        ),
        source_repo="umbra",
        source_commit=COMMIT,
        builder_id="test",
        command=["umbra", "image", "build"],
    )
    prov = tmp_path / "provenance.dsse.json"
    prov.write_text(sign_statement(st, key))
    # A Security CVM release: a Dev CVM's runs no container image (its sandbox image is pinned
    # by keys in dev-cvm.json).
    definition = tmp_path / "security.yaml"
    definition.write_text(yaml.safe_dump(security_definition_doc()))
    out = tmp_path / "release"
    done = runner.invoke(
        app,
        ["image", "measure", str(definition), "--out", str(out), "--sign-key", str(key_file),
         "--provenance", str(prov), "--json"],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    manifest = json.loads((out / "measurement-manifest.json").read_text())
    prov_sha = hashlib.sha256(prov.read_bytes()).hexdigest()
    assert {e["provenance_sha256"] for e in manifest["images"].values()} == {prov_sha}
    signed = str(out / "measurement-manifest.signed.json")
    base = ["image", "verify", signed, "-k", f"{key_file}.pub", "--json"]
    ok = runner.invoke(app, [*base, "-p", str(prov), "--commit", COMMIT])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["images"] == ["proxy"]
    wrong = runner.invoke(app, [*base, "-p", str(prov), "--commit", "e" * 40])
    assert wrong.exit_code != 0 and "expected" in wrong.output
    # A re-signed envelope by another key is both a different file and an unpinned signature.
    forged = tmp_path / "forged.json"
    forged.write_text(sign_statement(st, Ed25519PrivateKey.generate()))
    refused = runner.invoke(app, [*base, "-p", str(forged), "--commit", COMMIT])
    assert refused.exit_code != 0 and "was not given" in refused.output
