"""Key settings accept PEM text or a path to a PEM file; anything else stops startup."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from umbra.console.app import build_console
from umbra.console.config import ConfigError, Settings, settings_from_env
from umbra.policy.bundle import generate_key


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


def test_web_session_key_is_shared_by_workers_and_never_summarised() -> None:
    """Workers (and replicas) key web cookies from one setting, so a login on one is accepted by
    all; several workers without it are refused at start; the key never reaches the summary."""
    import base64
    import os
    import time

    from umbra.console.config import settings_summary
    from umbra.console.enums import Role
    from umbra.console.serve import serve
    from umbra.console.web.session import WebKeys, WebSession

    raw = os.urandom(32)
    encoded = base64.b64encode(raw).decode()
    session = WebSession("alice", {"t": Role.admin}, "csrf", int(time.time()) + 60)
    cookie = WebKeys(raw).seal_session(session)
    assert WebKeys(raw).open_session(cookie) == session  # another worker, same setting
    assert WebKeys().open_session(cookie) is None  # a per-process random key: refused
    url = "postgresql://u:p@127.0.0.1:1/db"
    base = {"UMBRA_CONSOLE_DATABASE_URL": url, "UMBRA_CONSOLE_OIDC_ISSUER": "https://idp.test"}
    settings = settings_from_env(base | {"UMBRA_CONSOLE_WEB_SESSION_KEY": encoded})
    assert settings.web_session_key == encoded
    assert encoded not in str(settings_summary(settings))
    with pytest.raises(ConfigError, match="UMBRA_CONSOLE_WEB_SESSION_KEY"):
        serve(settings_from_env(base), "127.0.0.1", 0, workers=2)
    for bad in ("not base64!", base64.b64encode(b"short").decode()):
        with pytest.raises(
            ConfigError, match=r"UMBRA_CONSOLE_WEB_SESSION_KEY: .*(base64|32 bytes)"
        ):
            settings_from_env(base | {"UMBRA_CONSOLE_WEB_SESSION_KEY": bad})


def test_an_unknown_console_variable_is_refused_with_a_suggestion(tmp_path: Path) -> None:
    """A misspelt setting used to be dropped silently (its default applied): now startup stops,
    naming the variable and the closest setting. Fails on the old code."""
    base = {"UMBRA_CONSOLE_DATABASE_URL": f"sqlite:///{tmp_path}/c.db"}
    with pytest.raises(ConfigError) as error:
        settings_from_env(base | {"UMBRA_CONSOLE_OIDC_ISUER": "https://issuer.example"})
    assert str(error.value) == (
        "UMBRA_CONSOLE_OIDC_ISUER: not a Console setting; did you mean UMBRA_CONSOLE_OIDC_ISSUER?"
    )
    with pytest.raises(
        ConfigError, match=r"^UMBRA_CONSOLE_NOTHING_LIKE_IT: not a Console setting$"
    ):
        settings_from_env(base | {"UMBRA_CONSOLE_NOTHING_LIKE_IT": "1"})
    # Read but not fields: the KEK file, and the Console's own worker hand-off.
    settings_from_env(base | {"UMBRA_CONSOLE__WORKER_SETTINGS": "{}", "OTHER": "x"})


def test_consoles_given_the_same_web_session_key_file_accept_each_others_cookies(
    tmp_path: Path,
) -> None:
    """What a Console VM's launch writes (console/web-session-key, issue 27): two Console apps
    (two replicas) reading the same file accept each other's web session cookie; one without it
    keys at random and refuses it. Both the key and its file at once, or an unreadable file, are
    refused by name, never echoing the key."""
    import base64
    import os
    import time

    from fastapi import FastAPI

    from umbra.console.app import create_app
    from umbra.console.enums import Role
    from umbra.console.web.session import WebSession

    encoded = base64.b64encode(os.urandom(32)).decode()
    key_file = tmp_path / "web-session-key"
    key_file.write_text(encoded + "\n")

    def app(name: str, extra: dict[str, str]) -> FastAPI:
        env = {"UMBRA_CONSOLE_DATABASE_URL": f"sqlite:///{tmp_path}/{name}.db"} | extra
        return create_app(settings_from_env(env))

    shared = {"UMBRA_CONSOLE_WEB_SESSION_KEY_FILE": str(key_file)}
    one, two, alone = app("one", shared), app("two", shared), app("alone", {})
    session = WebSession("alice", {"t": Role.admin}, "csrf", int(time.time()) + 60)
    cookie = one.state.web_keys.seal_session(session)
    assert two.state.web_keys.open_session(cookie) == session
    assert alone.state.web_keys.open_session(cookie) is None
    for built in (one, two, alone):
        built.state.console.engine.dispose()

    base = {"UMBRA_CONSOLE_DATABASE_URL": "sqlite://"}
    both = base | shared | {"UMBRA_CONSOLE_WEB_SESSION_KEY": encoded}
    with pytest.raises(ConfigError, match=r"WEB_SESSION_KEY and .*WEB_SESSION_KEY_FILE") as err:
        settings_from_env(both)
    assert encoded not in str(err.value)
    missing = base | {"UMBRA_CONSOLE_WEB_SESSION_KEY_FILE": str(tmp_path / "absent")}
    with pytest.raises(ConfigError, match="WEB_SESSION_KEY_FILE: cannot read"):
        settings_from_env(missing)
    key_file.write_text("short\n")
    with pytest.raises(ConfigError, match="UMBRA_CONSOLE_WEB_SESSION_KEY: ") as err:
        settings_from_env(base | shared)
    assert "short" not in str(err.value)
