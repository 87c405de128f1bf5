"""OIDC validation against a real issuer on loopback: issuer, audience, expiry, algorithms, and
key rotation picked up by refetching the JWKS."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Iterator

import pytest
from joserfc import jwt
from joserfc.jwk import RSAKey

from tests.console.helpers import Server
from tests.console.oidc_issuer import AUDIENCE, LocalIssuer
from umbra.console.oidc import IssuerUnavailable, OidcValidator, TokenError


@pytest.fixture
def own_issuer() -> Iterator[LocalIssuer]:
    issuer = LocalIssuer()
    yield issuer
    issuer.close()


def _validator(issuer: LocalIssuer, **kwargs: object) -> OidcValidator:
    options: dict[str, object] = {"allow_insecure_http": True, "min_refresh_interval": 0}
    options.update(kwargs)
    return OidcValidator(issuer.url, AUDIENCE, ["RS256", "ES256"], **options)  # type: ignore[arg-type]


def test_valid_token(own_issuer: LocalIssuer) -> None:
    claims = _validator(own_issuer).validate(own_issuer.token("alice", ["t:admin"]))
    assert claims.subject == "alice"
    assert claims.claims["umbra_roles"] == ["t:admin"]


@pytest.mark.parametrize(
    ("claims", "message"),
    [
        ({"iss": "https://evil.example"}, "iss"),
        ({"aud": "someone-else"}, "aud"),
        ({"exp": int(time.time()) - 3600}, "expired"),
        ({"nbf": int(time.time()) + 3600}, "not yet valid"),
    ],
)
def test_claims_are_checked(
    own_issuer: LocalIssuer, claims: dict[str, object], message: str
) -> None:
    with pytest.raises(TokenError, match=message):
        _validator(own_issuer).validate(own_issuer.token("alice", **claims))


def test_missing_sub_and_exp_are_refused(own_issuer: LocalIssuer) -> None:
    now = int(time.time())
    body = {"iss": own_issuer.url, "aud": AUDIENCE, "iat": now}
    key = own_issuer.signing_key
    no_exp = jwt.encode({"alg": "RS256", "kid": key.kid}, {**body, "sub": "a"}, key)
    no_sub = jwt.encode({"alg": "RS256", "kid": key.kid}, {**body, "exp": now + 60}, key)
    validator = _validator(own_issuer)
    for token in (no_exp, no_sub):
        with pytest.raises(TokenError):
            validator.validate(token)


def test_algorithm_confusion_and_none_are_refused(own_issuer: LocalIssuer) -> None:
    validator = _validator(own_issuer)
    kid = own_issuer.signing_key.kid
    body = {"iss": own_issuer.url, "aud": AUDIENCE, "sub": "a", "exp": int(time.time()) + 60}
    # HS256 keyed with the issuer's public key material.
    public_pem = own_issuer.signing_key.as_pem(private=False)
    payload = _b64(json.dumps(body).encode())
    signing_input = _b64(json.dumps({"alg": "HS256", "kid": kid}).encode()) + b"." + payload
    mac = hmac.new(public_pem, signing_input, hashlib.sha256).digest()
    with pytest.raises(TokenError):
        validator.validate((signing_input + b"." + _b64(mac)).decode())
    header = _b64(json.dumps({"alg": "none", "kid": kid}).encode())
    with pytest.raises(TokenError):
        validator.validate((header + b"." + payload + b".").decode())
    forged = own_issuer.token("a", key=RSAKey.generate_key(2048), kid=kid)
    with pytest.raises(TokenError, match="signature"):
        validator.validate(forged)
    for junk in ("", "a.b.c", "x" * 20000, "!!!.###.$$$"):
        with pytest.raises(TokenError):
            validator.validate(junk)


def _b64(raw: bytes) -> bytes:
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


def test_keys_are_cached_and_rotation_is_picked_up(own_issuer: LocalIssuer) -> None:
    validator = _validator(own_issuer)
    old_token = own_issuer.token("alice")
    validator.validate(old_token)
    fetches = own_issuer.jwks_fetches
    for _ in range(5):
        validator.validate(old_token)
    assert own_issuer.jwks_fetches == fetches  # cached
    own_issuer.rotate(keep_old=False)
    new_token = own_issuer.token("alice")
    assert validator.validate(new_token).subject == "alice"  # unknown kid -> refetch
    assert own_issuer.jwks_fetches == fetches + 1
    with pytest.raises(TokenError):
        validator.validate(old_token)  # the retired key is gone


def test_unknown_kid_refetch_is_rate_limited(own_issuer: LocalIssuer) -> None:
    validator = _validator(own_issuer, min_refresh_interval=60)
    validator.validate(own_issuer.token("alice"))
    fetches = own_issuer.jwks_fetches
    for _ in range(3):
        with pytest.raises(TokenError):
            validator.validate(own_issuer.token("a", key=RSAKey.generate_key(2048), kid="nope"))
    assert own_issuer.jwks_fetches == fetches


def test_issuer_must_match_discovery_and_be_https() -> None:
    with pytest.raises(ValueError, match="https"):
        OidcValidator("http://127.0.0.1:1", AUDIENCE, ["RS256"])
    with pytest.raises(ValueError, match="asymmetric"):
        OidcValidator("https://127.0.0.1:1", AUDIENCE, ["HS256"])


def test_unreachable_issuer_is_503_not_500(own_issuer: LocalIssuer) -> None:
    validator = OidcValidator(
        own_issuer.url + "/elsewhere", AUDIENCE, ["RS256"], allow_insecure_http=True
    )
    with pytest.raises(IssuerUnavailable):
        validator.validate(own_issuer.token("alice"))


def test_console_rejects_bad_tokens_with_401(server: Server, issuer: LocalIssuer) -> None:
    bad = [
        issuer.token("alice", aud="other"),
        issuer.token("alice", exp=int(time.time()) - 3600),
        "not-a-jwt",
    ]
    for token in bad:
        with server.client(token) as client:
            response = client.get("/api/v1/me")
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
    with server.client() as client:
        assert client.get("/api/v1/me", headers={"Authorization": "Basic YTpi"}).status_code == 401


def test_a_removed_key_stops_working_at_the_next_refresh(own_issuer: LocalIssuer) -> None:
    validator = _validator(own_issuer, jwks_ttl=0.2)
    old_token = own_issuer.token("alice")
    validator.validate(old_token)
    own_issuer.rotate(keep_old=False)
    fetches = own_issuer.jwks_fetches
    deadline = time.monotonic() + 10
    while True:  # the stale set is used while the refetch runs in the background
        try:
            validator.validate(old_token)
        except TokenError:
            break
        assert time.monotonic() < deadline, "the removed key still verifies"
        time.sleep(0.05)
    assert own_issuer.jwks_fetches > fetches
    assert validator.validate(own_issuer.token("alice")).subject == "alice"


def test_role_entries_match_exactly() -> None:
    from umbra.console.deps import parse_roles

    assert parse_roles(["teama:admin\n", " teama:admin", "teama:admin ", "teamb:developer"]) == {
        "teamb": "developer"
    }
