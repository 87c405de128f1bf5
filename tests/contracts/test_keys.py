"""The one Ed25519 key-file helper (`contracts.keys`): round trip, 0600, no overwrite, precise
errors that name the file and never show key bytes."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from umbra.contracts.keys import (
    KeyFileError,
    key_fingerprint,
    load_private_key,
    load_public_key,
    write_key_pair,
)
from umbra.images.signing import key_id


def test_round_trip_mode_and_no_overwrite(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    private = tmp_path / "d" / "release.key"
    public = write_key_pair(key, private)
    assert public == tmp_path / "d" / "release.key.pub"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert key_fingerprint(load_private_key(private).public_key()) == key_fingerprint(
        load_public_key(public)
    )
    # manifests and bundles name keys by the same fingerprint
    assert key_id(load_public_key(public)) == key_fingerprint(key.public_key())
    before = private.read_bytes()
    with pytest.raises(KeyFileError, match="exists; refusing to overwrite"):
        write_key_pair(Ed25519PrivateKey.generate(), private)
    assert private.read_bytes() == before


def test_bad_files_name_the_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")
    with pytest.raises(KeyFileError, match=re.escape(f"{junk}: cannot load private key")):
        load_private_key(junk)
    with pytest.raises(KeyFileError, match=re.escape(f"{junk}: cannot load public key")):
        load_public_key(junk)
    with pytest.raises(KeyFileError, match=r"missing\.pem: cannot load"):
        load_public_key(tmp_path / "missing.pem")
    key = Ed25519PrivateKey.generate()
    public = write_key_pair(key, tmp_path / "k")
    with pytest.raises(KeyFileError, match="cannot load private key"):
        load_private_key(public)  # a public key where a private one belongs
