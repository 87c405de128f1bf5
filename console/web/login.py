"""The browser login: OIDC authorization code flow with PKCE (S256) against the Console's issuer.

The Console is a public client (`client_id` = the configured audience) and keeps no client secret.
`state` and the PKCE verifier travel in a short-lived signed cookie; the access token returned by
the token endpoint is validated by the same `OidcValidator` that guards the API, so the web view
and the API agree on who a user is and which roles they hold.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from dataclasses import dataclass
from urllib.parse import urlencode

import httpx

from umbra.console.deps import parse_roles
from umbra.console.oidc import IssuerUnavailable, TokenError
from umbra.console.state import Console
from umbra.console.web.session import WebSession, new_session

TIMEOUT = 5.0


class LoginError(Exception):
    """The login cannot complete; the message is safe to show (never a token or code)."""


@dataclass(frozen=True)
class Endpoints:
    authorization: str
    token: str


@dataclass(frozen=True)
class LoginStart:
    url: str
    state: str
    verifier: str


def _endpoints(console: Console) -> Endpoints:
    if console.oidc is None:
        raise LoginError("OIDC is not configured on this Console")
    issuer = console.oidc.issuer
    url = issuer.rstrip("/") + "/.well-known/openid-configuration"
    try:
        with httpx.Client(timeout=TIMEOUT, follow_redirects=False) as client:
            document = client.get(url, headers={"Accept": "application/json"}).json()
    except (httpx.HTTPError, ValueError):
        raise LoginError("the identity provider's discovery document is unavailable") from None
    if not isinstance(document, dict) or document.get("issuer") != issuer:
        raise LoginError("the discovery document names a different issuer")
    found = []
    for key in ("authorization_endpoint", "token_endpoint"):
        value = document.get(key)
        if not isinstance(value, str) or not value.startswith(("https://", "http://")):
            raise LoginError(f"the identity provider offers no {key}")
        if value.startswith("http://") and not console.settings.oidc_allow_insecure_http:
            raise LoginError(f"{key} is not https://")
        found.append(value)
    return Endpoints(*found)


def pkce_challenge(verifier: str) -> str:
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def start(console: Console, redirect_uri: str) -> LoginStart:
    endpoints = _endpoints(console)
    state = secrets.token_urlsafe(24)
    verifier = secrets.token_urlsafe(48)
    query = urlencode(
        {
            "response_type": "code",
            "client_id": console.settings.oidc_audience,
            "redirect_uri": redirect_uri,
            "scope": "openid",
            "state": state,
            "code_challenge": pkce_challenge(verifier),
            "code_challenge_method": "S256",
        }
    )
    separator = "&" if "?" in endpoints.authorization else "?"
    return LoginStart(endpoints.authorization + separator + query, state, verifier)


def finish(console: Console, code: str, verifier: str, redirect_uri: str) -> WebSession:
    assert console.oidc is not None  # start() refused otherwise
    endpoints = _endpoints(console)
    form = {
        "grant_type": "authorization_code",
        "code": code,
        "redirect_uri": redirect_uri,
        "client_id": console.settings.oidc_audience,
        "code_verifier": verifier,
    }
    try:
        with httpx.Client(timeout=TIMEOUT, follow_redirects=False) as client:
            response = client.post(endpoints.token, data=form)
            document = response.json()
    except (httpx.HTTPError, ValueError):
        raise LoginError("the identity provider's token endpoint is unavailable") from None
    if response.status_code != 200 or not isinstance(document, dict):
        raise LoginError(f"the identity provider refused the login ({response.status_code})")
    token = document.get("access_token")
    if not isinstance(token, str):
        raise LoginError("the identity provider returned no access token")
    try:
        claims = console.oidc.validate(token)
    except TokenError as exc:
        raise LoginError(f"the access token is not valid here: {exc}") from None
    except IssuerUnavailable as exc:
        raise LoginError(str(exc)) from None
    roles = parse_roles(claims.claims.get(console.settings.oidc_roles_claim))
    expires = claims.claims.get("exp")
    return new_session(claims.subject, roles, int(expires) if isinstance(expires, int) else 0)
