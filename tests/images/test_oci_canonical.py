"""The OCI config and manifest are serialized by the one canonical JSON (`contracts/canonical`),
byte for byte as before: image digests are pinned in compose files and measured, so a changed
serialization would change every image reference."""

from __future__ import annotations

import hashlib
import json

from umbra.contracts.canonical import canonical_json
from umbra.images.oci import ImageConfig, image_config, oci_manifest

LAYER = "ab" * 32
CFG = ImageConfig(
    Entrypoint=["/bin/ünï"],
    Cmd=["-c", "x"],
    User="1000",
    WorkingDir="/w",
    Env=["A=é"],
    Labels={"b": "2", "a": "1"},
)


def test_config_and_manifest_bytes_are_unchanged() -> None:
    # Digests recorded from the serializer images/oci.py had before it used contracts/canonical.
    config = image_config(LAYER, CFG, 1700000000)
    manifest = oci_manifest(config, LAYER, 12345)
    assert hashlib.sha256(config).hexdigest() == (
        "84e42a8b9637168f0a49294a9b988814b3d6fab5febd5bd9c1a04fb96c64c4e5"
    )
    assert hashlib.sha256(manifest).hexdigest() == (
        "57dc9bc7c27ddac4c6831c82d681f803c4bc530f8cc83c620645469a4f669f89"
    )
    # UTF-8, not JSON escapes: the canonical form without `ascii_only`.
    assert "/bin/ünï".encode() in config
    assert config == canonical_json(json.loads(config))
