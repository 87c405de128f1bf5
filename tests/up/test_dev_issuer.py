"""The development issuer over real HTTP: its grants work, and the Console trusts it only in
embedded mode (which itself is refused with PostgreSQL or a non-loopback issuer)."""

from __future__ import annotations

import base64
import hashlib
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from umbra.console.config import ConfigError, settings_from_env
from umbra.console.dev_issuer import DEV_ISSUER_MARKER, DEVICE_GRANT, DevIssuer, _handler
from umbra.console.oidc import IssuerUnavailable, OidcValidator


@pytest.fixture
def issuer(tmp_path: Path) -> Iterator[DevIssuer]:
    state = DevIssuer(tmp_path / "issuer", "dev@umbra.local", ["local:admin"])
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def _validator(issuer: DevIssuer, accept: bool) -> OidcValidator:
    return OidcValidator(
        issuer.url,
        "umbra-console",
        ["RS256"],
        allow_insecure_http=True,
        min_refresh_interval=0,
        accept_development_issuer=accept,
    )


def test_device_grant_refresh_and_the_console_accepts_it_only_in_embedded_mode(
    issuer: DevIssuer,
) -> None:
    with httpx.Client(base_url=issuer.url) as http:
        discovery = http.get("/.well-known/openid-configuration").json()
        assert discovery[DEV_ISSUER_MARKER] is True
        grant = http.post("/device", data={"client_id": "umbra-cli"}).json()
        tokens = http.post(
            "/token", data={"grant_type": DEVICE_GRANT, "device_code": grant["device_code"]}
        ).json()
        # Device codes are single use; refresh tokens rotate.
        reused = http.post(
            "/token", data={"grant_type": DEVICE_GRANT, "device_code": grant["device_code"]}
        )
        assert reused.status_code == 400
        refreshed = http.post(
            "/token", data={"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]}
        )
        assert refreshed.status_code == 200
        again = http.post(
            "/token", data={"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]}
        )
        assert again.status_code == 400
    claims = _validator(issuer, accept=True).validate(tokens["access_token"])
    assert claims.subject == "dev@umbra.local"
    with pytest.raises(IssuerUnavailable):  # fails closed: no token validates
        _validator(issuer, accept=False).validate(tokens["access_token"])


def test_authorization_code_needs_pkce_and_a_loopback_redirect(issuer: DevIssuer) -> None:
    verifier = "v" * 64
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=")
    redirect = "http://127.0.0.1:9/callback"
    query = {
        "response_type": "code",
        "client_id": "umbra-web",
        "redirect_uri": redirect,
        "code_challenge": challenge.decode(),
        "code_challenge_method": "S256",
        "state": "xyz",
    }
    with httpx.Client(base_url=issuer.url, follow_redirects=False) as http:
        assert (
            http.get("/authorize", params={**query, "code_challenge_method": "plain"}).status_code
            == 400
        )
        assert (
            http.get("/authorize", params={**query, "redirect_uri": "https://evil.example/cb"})
        ).status_code == 400
        answer = http.get("/authorize", params=query)
        assert answer.status_code == 302
        back = parse_qs(urlsplit(answer.headers["location"]).query)
        assert back["state"] == ["xyz"]
        form = {
            "grant_type": "authorization_code",
            "code": back["code"][0],
            "redirect_uri": redirect,
        }
        wrong = http.post("/token", data={**form, "code_verifier": "w" * 64})
        assert wrong.status_code == 400  # and the code is spent
        answer = http.get("/authorize", params=query)
        code = parse_qs(urlsplit(answer.headers["location"]).query)["code"][0]
        good = http.post("/token", data={**form, "code": code, "code_verifier": verifier})
        assert good.status_code == 200 and good.json()["access_token"]


@pytest.mark.parametrize(
    ("database", "issuer"),
    [
        ("postgresql+psycopg://u@db/umbra", "http://127.0.0.1:7080"),
        ("sqlite:///x.db", "https://login.example.com"),
    ],
)
def test_embedded_mode_is_refused_outside_one_machine(database: str, issuer: str) -> None:
    with pytest.raises(ConfigError, match="embedded_dev"):
        settings_from_env(
            {
                "UMBRA_CONSOLE_EMBEDDED_DEV": "true",
                "UMBRA_CONSOLE_DATABASE_URL": database,
                "UMBRA_CONSOLE_OIDC_ISSUER": issuer,
            }
        )
