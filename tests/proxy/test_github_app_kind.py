"""The `github-app` secret kind: its document checked field by field without echoing the key, and
the JWT the Security CVM signs as the app kept inside GitHub's rules (iat 60 s back, exp <= 10 min
after the time of the call, RS256 over the app id)."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from pydantic import ValidationError

from umbra.contracts.secret_kinds import GitHubApp, SecretKind, material_text, parse_material
from umbra.contracts.validation import problems
from umbra.proxy.mint_errors import CredentialRefused
from umbra.proxy.minting import github_app_jwt

RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey, pkcs8: bool = False) -> str:
    fmt = (
        serialization.PrivateFormat.PKCS8
        if pkcs8
        else serialization.PrivateFormat.TraditionalOpenSSL
    )
    return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()).decode()


def doc(**fields: object) -> str:
    return json.dumps({"app_id": 42, "installation_id": 7, "private_key": pem(RSA_KEY)} | fields)


@pytest.mark.parametrize("pkcs8", [False, True])
def test_a_github_app_document_parses_with_the_default_api(pkcs8: bool) -> None:
    material = parse_material(SecretKind.github_app, doc(private_key=pem(RSA_KEY, pkcs8)))
    assert isinstance(material, GitHubApp) and material.api_url == "https://api.github.com"
    assert repr(material) == "GitHubApp(<redacted>)" and material.sensitive() == [
        material.private_key
    ]
    assert parse_material(SecretKind.github_app, material_text(material)) == material


EC_PEM = pem(ec.generate_private_key(ec.SECP256R1()))


@pytest.mark.parametrize(
    ("fields", "field", "why"),
    [
        ({"private_key": EC_PEM}, "private_key", "RSA private key in PEM"),
        ({"private_key": "ghp_notakey"}, "private_key", "RSA private key in PEM"),
        ({"app_id": 0}, "app_id", "greater than or equal to 1"),
        ({"installation_id": "seven"}, "installation_id", "integer"),
        ({"api_url": "http://github.example"}, "api_url", "https://"),
        ({"api_url": "https://user:pw@github.example"}, "api_url", "no user info"),
        ({"client_secret": "x"}, "client_secret", "Extra inputs"),
    ],
)
def test_a_bad_document_names_the_field_and_never_the_key(
    fields: dict[str, object], field: str, why: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        parse_material(SecretKind.github_app, doc(**fields))
    message = problems(caught.value)
    assert f"github-app.{field}" in message and why in message, message
    for value in (pem(RSA_KEY), EC_PEM):
        body = value.splitlines()[2]
        assert body not in message and body not in str(caught.value)


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def test_the_app_jwt_keeps_githubs_rules() -> None:
    material = parse_material(SecretKind.github_app, doc())
    assert isinstance(material, GitHubApp)
    now = 1_700_000_000.5
    head, body, signature = github_app_jwt(material, now).split(".")
    header, claims = json.loads(_unb64(head)), json.loads(_unb64(body))
    assert header == {"alg": "RS256", "typ": "JWT"}
    assert claims["iss"] == "42" and claims["iat"] == int(now) - 60
    assert now < claims["exp"] <= now + 600 and claims["exp"] - claims["iat"] <= 600
    RSA_KEY.public_key().verify(
        _unb64(signature), f"{head}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256()
    )


def test_a_key_that_does_not_load_is_a_refusal_without_the_key() -> None:
    # The PEM shape passes the contract; a corrupt body only fails when the CVM loads it.
    lines = pem(RSA_KEY).splitlines()
    corrupt = "\n".join([lines[0], "QUJD" * 16, lines[-1]])
    material = parse_material(SecretKind.github_app, doc(private_key=corrupt))
    assert isinstance(material, GitHubApp)
    with pytest.raises(CredentialRefused) as caught:
        github_app_jwt(material, 0)
    assert "QUJD" not in str(caught.value)
