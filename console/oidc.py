"""OIDC bearer-token validation against the issuer's JWKS.

Discovery (`/.well-known/openid-configuration`) must name the configured issuer; keys are cached
for a TTL and refetched early when a token names an unknown `kid`, which is how key rotation at the
issuer converges without a restart (a key the issuer removed stops verifying at that refetch).

The issuer can never stall the Console: fetching happens on one background thread at a time
(single flight), attempts are rate limited whether they succeed or fail, and no lock is held
during I/O. A token with a known `kid` never waits. A token with an unknown `kid` (or any token
before the first keys arrive) waits for the fetch in flight only if a few slots are free, and only
up to a bound; every other such request is answered at once (401, or 503 without keys). Only asymmetric algorithms from the configured
allowlist are accepted, so `none` and HMAC-with-the-public-key confusions cannot verify.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

from umbra.console.dev_issuer import DEV_ISSUER_MARKER

log = logging.getLogger(__name__)

ASYMMETRIC_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
MAX_TOKEN_LENGTH = 16 << 10


class TokenError(Exception):
    """A bearer token that does not authenticate anyone; the message says why, never the token."""


class IssuerUnavailable(Exception):
    """The issuer's discovery document or JWKS cannot be fetched or parsed."""


@dataclass(frozen=True)
class Claims:
    subject: str
    claims: Mapping[str, Any]


class OidcValidator:
    def __init__(
        self,
        issuer: str,
        audience: str,
        algorithms: list[str],
        *,
        jwks_ttl: float = 300.0,
        min_refresh_interval: float = 5.0,
        leeway: int = 30,
        allow_insecure_http: bool = False,
        http_timeout: float = 5.0,
        accept_development_issuer: bool = False,
        max_waiters: int = 4,
        failure_backoff: float = 2.0,
    ) -> None:
        unsupported = set(algorithms) - ASYMMETRIC_ALGORITHMS
        if unsupported:
            raise ValueError(f"oidc_algorithms: not asymmetric signature algorithms: {unsupported}")
        if not issuer.startswith("https://") and not (
            allow_insecure_http and issuer.startswith("http://")
        ):
            raise ValueError("oidc_issuer: must be an https:// URL")
        self.issuer = issuer
        self.audience = audience
        self.algorithms = list(algorithms)
        self._ttl = jwks_ttl
        self._min_refresh = min_refresh_interval
        self._failure_backoff = max(failure_backoff, min_refresh_interval)
        self._leeway = leeway
        self._timeout = http_timeout
        # Discovery and JWKS are two requests, each bounded by the timeout.
        self._wait_bound = 2 * http_timeout + 1
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._waiters = threading.BoundedSemaphore(max_waiters)
        self._keys: KeySet | None = None
        self._kids: frozenset[str] = frozenset()
        self._fetched_at = 0.0
        self._next_attempt = 0.0
        self._refreshing = False
        self._attempts = 0  # completed fetch attempts, successful or not
        self._jwks_uri: str | None = None
        self._accept_development_issuer = accept_development_issuer

    # -- key management ---------------------------------------------------------------------
    def _discover(self, client: httpx.Client) -> str:
        url = self.issuer.rstrip("/") + "/.well-known/openid-configuration"
        document = _get_json(client, url)
        if document.get("issuer") != self.issuer:
            raise IssuerUnavailable("discovery document names a different issuer")
        # `umbra up`'s issuer approves every login of its one user: only embedded mode trusts it.
        if document.get(DEV_ISSUER_MARKER) is not None and not self._accept_development_issuer:
            raise IssuerUnavailable(
                "the issuer is Umbra's development issuer, trusted only in embedded mode (umbra up)"
            )
        jwks_uri = document.get("jwks_uri")
        if not isinstance(jwks_uri, str) or not jwks_uri.startswith(("https://", "http://")):
            raise IssuerUnavailable("discovery document has no usable jwks_uri")
        return jwks_uri

    def _fetch(self) -> tuple[KeySet, frozenset[str]]:
        """Network I/O only; runs on the refresh thread, never under the lock."""
        with httpx.Client(timeout=self._timeout, follow_redirects=False) as client:
            jwks_uri = self._jwks_uri or self._discover(client)
            self._jwks_uri = jwks_uri
            document = _get_json(client, jwks_uri)
        keys = document.get("keys")
        if not isinstance(keys, list):
            raise IssuerUnavailable("JWKS has no 'keys' list")
        usable = [
            key
            for key in keys
            if isinstance(key, dict) and key.get("use", "sig") == "sig" and key.get("kty") != "oct"
        ]
        try:
            key_set = KeySet.import_key_set({"keys": usable})
        except (JoseError, ValueError, TypeError) as exc:
            raise IssuerUnavailable(f"JWKS does not parse: {type(exc).__name__}") from None
        return key_set, frozenset(str(key.get("kid")) for key in usable if key.get("kid"))

    def _refresh_thread(self) -> None:
        fetched: tuple[KeySet, frozenset[str]] | None = None
        try:
            fetched = self._fetch()
        except (httpx.HTTPError, IssuerUnavailable) as exc:
            log.warning("OIDC key refresh failed: %s", type(exc).__name__)
        except Exception as exc:  # never let the refresher die silently with the flag set
            log.error("OIDC key refresh failed unexpectedly: %s", type(exc).__name__)
        with self._changed:
            now = time.monotonic()
            if fetched is not None:
                self._keys, self._kids = fetched  # replaces: removed keys stop verifying
                self._fetched_at = now
                self._next_attempt = now + self._min_refresh
            else:
                self._next_attempt = now + self._failure_backoff
            self._refreshing = False
            self._attempts += 1
            self._changed.notify_all()

    def refresh_soon(self) -> None:
        """Start a fetch now if none is running and the rate limit allows (startup, tests)."""
        with self._lock:
            self._start_locked(time.monotonic())

    def _start_locked(self, now: float) -> bool:
        if self._refreshing or now < self._next_attempt:
            return self._refreshing
        self._refreshing = True
        self._next_attempt = now + self._min_refresh
        threading.Thread(target=self._refresh_thread, name="umbra-oidc-jwks", daemon=True).start()
        return True

    def _key_set(self, kid: str | None) -> KeySet:
        with self._lock:
            now = time.monotonic()
            stale = self._keys is None or now - self._fetched_at > self._ttl
            unknown = kid is not None and kid not in self._kids
            in_flight = self._start_locked(now) if stale or unknown else self._refreshing
            keys, attempts = self._keys, self._attempts
        if keys is not None and not unknown:
            return keys  # known key (stale keys are refreshed in the background meanwhile)
        if in_flight and self._waiters.acquire(blocking=False):
            try:
                with self._changed:
                    self._changed.wait_for(
                        lambda: self._attempts != attempts, timeout=self._wait_bound
                    )
                    keys = self._keys
            finally:
                self._waiters.release()
        if keys is None:
            raise IssuerUnavailable("the OIDC issuer's keys are unavailable")
        return keys  # an unknown kid that is still unknown fails verification: 401

    # -- validation -----------------------------------------------------------------------
    def validate(self, token: str) -> Claims:
        if len(token) > MAX_TOKEN_LENGTH:
            raise TokenError("token is too long")
        kid = _unverified_kid(token)
        keys = self._key_set(kid)
        try:
            decoded = jwt.decode(token, keys, algorithms=self.algorithms)
        except (JoseError, ValueError, TypeError) as exc:
            raise TokenError(f"token signature does not verify ({type(exc).__name__})") from None
        if decoded.header.get("alg") not in self.algorithms:
            raise TokenError("token algorithm is not allowed")
        registry = jwt.JWTClaimsRegistry(
            leeway=self._leeway,
            iss={"essential": True, "value": self.issuer},
            aud={"essential": True, "value": self.audience},
            exp={"essential": True},
            sub={"essential": True},
        )
        try:
            registry.validate(decoded.claims)
        except JoseError as exc:
            raise TokenError(f"token claims are invalid: {exc.description or exc.error}") from None
        subject = decoded.claims.get("sub")
        if (
            not isinstance(subject, str)
            or not subject
            or len(subject) > 255
            or any(ord(char) < 0x20 or ord(char) == 0x7F for char in subject)
        ):
            raise TokenError("token has no usable 'sub'")
        return Claims(subject=subject, claims=decoded.claims)


def _unverified_kid(token: str) -> str | None:
    head = token.split(".", 1)[0]
    try:
        header = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))
    except ValueError:
        raise TokenError("token is not a JWS compact serialization") from None
    if not isinstance(header, dict):
        raise TokenError("token header is not a JSON object")
    kid = header.get("kid")
    return kid if isinstance(kid, str) else None


def _get_json(client: httpx.Client, url: str) -> dict[str, Any]:
    response = client.get(url, headers={"Accept": "application/json"})
    if response.status_code != 200:
        raise IssuerUnavailable(f"{url} answered {response.status_code}")
    try:
        document = response.json()
    except ValueError:
        raise IssuerUnavailable(f"{url} did not return JSON") from None
    if not isinstance(document, dict):
        raise IssuerUnavailable(f"{url} did not return a JSON object")
    return document
