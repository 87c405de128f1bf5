"""Key settings accept PEM text or a path to a PEM file; anything else stops startup."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from umbra.console.app import build_console
from umbra.console.config import ConfigError, Settings, settings_from_env
from umbra.proxy.policy.bundle import generate_key


def test_bundle_keys_as_pem_text_or_path(tmp_path: Path) -> None:
    pem = (
        generate_key()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    path = tmp_path / "k.pub"
    path.write_text(pem)
    settings = settings_from_env(
        {
            "UMBRA_CONSOLE_DATABASE_URL": f"sqlite:///{tmp_path}/c.db",
            "UMBRA_CONSOLE_BUNDLE_PUBLIC_KEYS": f"{pem},{path}",
        }
    )
    console = build_console(settings)
    try:
        assert len(console.bundle_keys) == 2
    finally:
        console.engine.dispose()
    broken = Settings(
        database_url=f"sqlite:///{tmp_path}/c.db",
        bundle_public_keys=["-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----"],
    )
    with pytest.raises(ConfigError, match="bundle_public_keys: PEM text"):
        build_console(broken)
