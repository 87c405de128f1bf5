"""Access tokens minted on the Security CVM: from a refresh token, client credentials, a Google
service-account key (JWT bearer grant, RFC 7523) or a GitHub App's key (a JWT signed as the app,
exchanged for an installation token), cached and refreshed before they expire.

- Warm path: a cached token with more than `margin` seconds left is returned without awaiting
  anything; one inside the margin is still used while a refresh runs in the background.
- Single flight per secret: concurrent requests for one secret share one call to the token
  endpoint; other secrets and other flows never wait on it.
- Bounded: a request waits at most `wait` seconds (then `CredentialUnavailable`); the call itself
  is bounded by the HTTP client's timeout. A failure that is not a refusal holds further attempts
  for `hold` seconds, so a down endpoint sees no retry storm.
- A refusal (HTTP 400/401/403 from the token endpoint) is final for that version of the secret:
  every request needing it is refused at once (`CredentialRefused`) until a new version arrives
  (a new login), and a rotating chain is reported to the Console as needing a login.
- Rotating refresh tokens: the refresh is leased at the Console and the new chain committed back
  under the lease (`RefreshPersister`, console/services/secret_refresh.py), so replicas keep one
  chain. Without a Console (a local secrets file) the rotated token is kept in memory only.
- The token endpoint is dialled like any upstream (`proxy/token_dialer.py`): resolved by the
  proxy's resolver, every address checked by its address policy, TLS verified (a `token_url`
  naming a private address is refused).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import httpx
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from umbra.contracts.secret_kinds import (
    GitHubApp,
    GoogleServiceAccount,
    OAuth2ClientCredentials,
    OAuth2Refresh,
)
from umbra.proxy.config import ProxyConfig
from umbra.proxy.mint_errors import (
    CredentialRefused,
    CredentialUnavailable,
    LeaseBusy,
    MintError,
    RefreshPersister,
)
from umbra.proxy.netcheck import AddressPolicy
from umbra.proxy.refresh_client import ConsoleRefresh
from umbra.proxy.resolver import Resolver
from umbra.proxy.secrets import Material, SecretKey
from umbra.proxy.state import PolicyState
from umbra.proxy.token_dialer import TokenDialer

logger = logging.getLogger("umbra.proxy.minting")

JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
# Errors of RFC 6749 §5.2 that mean "this credential will not work", as opposed to "try later".
REFUSALS = frozenset(
    {
        "invalid_grant",
        "invalid_client",
        "unauthorized_client",
        "invalid_scope",
        "unsupported_grant_type",
        "invalid_request",
        "access_denied",
    }
)


@dataclass(frozen=True)
class Minted:
    token: str
    expires_at: float  # Unix time
    refresh_at: float  # from here on a request triggers a refresh ahead of expiry

    def __repr__(self) -> str:
        return f"Minted(expires_at={self.expires_at}, token=<redacted>)"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def google_assertion(material: GoogleServiceAccount, now: float) -> str:
    """The RS256-signed JWT of the JWT bearer grant (what google-auth's service account sends)."""
    header = {"alg": "RS256", "typ": "JWT"}
    if material.private_key_id:
        header["kid"] = material.private_key_id
    issued = int(now)
    claims = {
        "iss": material.client_email,
        "scope": " ".join(material.scopes),
        "aud": material.token_uri,
        "iat": issued,
        "exp": issued + 3600,
    }
    return _rs256(header, claims, material.private_key, "the service account's")


# GitHub's rules for an app's JWT: `iat` 60 s in the past (clock drift), `exp` at most 10 min
# after the time of the call; 9 min after `iat` keeps inside both.
GITHUB_JWT_BACKDATE = 60
GITHUB_JWT_LIFETIME = 540


def github_app_jwt(material: GitHubApp, now: float) -> str:
    """The RS256 JWT a GitHub App authenticates as itself with (`iss` = the app id)."""
    issued = int(now) - GITHUB_JWT_BACKDATE
    claims = {"iss": str(material.app_id), "iat": issued, "exp": issued + GITHUB_JWT_LIFETIME}
    return _rs256({"alg": "RS256", "typ": "JWT"}, claims, material.private_key, "the app's")


def _rs256(header: dict[str, str], claims: dict[str, Any], pem: str, whose: str) -> str:
    signing_input = (
        _b64url(json.dumps(header, separators=(",", ":")).encode())
        + "."
        + _b64url(json.dumps(claims, separators=(",", ":")).encode())
    )
    try:
        key = serialization.load_pem_private_key(pem.encode(), password=None)
    except (ValueError, TypeError):
        raise CredentialRefused(f"{whose} private key does not load") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise CredentialRefused(f"{whose} private key is not RSA")
    signature = key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
    return signing_input + "." + _b64url(signature)


@dataclass
class _Entry:
    minted: Minted | None = None
    refused_version: int | None = None
    hold_until: float = 0.0
    hold_reason: str = ""
    # The newest chain this proxy holds (after a rotation it committed, or kept in memory).
    chain: Material | None = None


class Minter:
    def __init__(
        self,
        dialer: TokenDialer,
        persister: RefreshPersister | None = None,
        *,
        wait: float = 10.0,
        margin: float = 60.0,
        hold: float = 5.0,
        clock: Callable[[], float] = time.time,
        lookup: Callable[[SecretKey], Material | None] | None = None,
    ) -> None:
        self.dialer = dialer
        # The newest released version of a secret (the secret puller's store), for a replica
        # waiting on another's rotation.
        self.lookup = lookup
        self.persister = persister
        self.wait = wait
        self.margin = margin
        self.hold = hold
        self.clock = clock
        self._entries: dict[SecretKey, _Entry] = {}
        self._inflight: dict[SecretKey, asyncio.Task[Minted]] = {}
        self.calls = 0  # token endpoint calls made (tests and benchmarks count them)

    def _entry(self, key: SecretKey, material: Material) -> tuple[_Entry, Material]:
        """The entry for `key`, brought up to date with the released `material`: a newer version
        (a new login, or another replica's rotation) replaces what this proxy held."""
        entry = self._entries.setdefault(key, _Entry())
        current = entry.chain
        if current is None or material.version > current.version:
            entry.minted = _carried(material)  # a new login carries none: mint afresh
            entry.chain = current = material
        elif material.needs_login and material.version == current.version:
            entry.chain = current = material
        return entry, current

    def cached(self, key: SecretKey, material: Material) -> str | None:
        """A token usable now without awaiting (the warm path), else None."""
        entry, current = self._entry(key, material)
        minted = entry.minted
        if minted is None or current.needs_login or entry.refused_version == current.version:
            return None
        now = self.clock()
        if minted.expires_at <= now:
            return None
        if minted.refresh_at <= now and key not in self._inflight:
            self._start(key, current)  # refresh ahead; this request keeps the current token
        return minted.token

    async def token(self, key: SecretKey, material: Material) -> str:
        warm = self.cached(key, material)
        if warm is not None:
            return warm
        entry, current = self._entry(key, material)
        if current.needs_login or entry.refused_version == current.version:
            raise CredentialRefused("the token endpoint refused this credential; log in again")
        if self.clock() < entry.hold_until and key not in self._inflight:
            raise CredentialUnavailable(entry.hold_reason or "the token endpoint failed recently")
        task = self._inflight.get(key) or self._start(key, current)
        try:
            minted = await asyncio.wait_for(asyncio.shield(task), self.wait)
        except TimeoutError:
            raise CredentialUnavailable(
                f"the token endpoint did not answer within {self.wait:g} s"
            ) from None
        return minted.token

    def _start(self, key: SecretKey, material: Material) -> asyncio.Task[Minted]:
        task = asyncio.get_running_loop().create_task(self._mint(key, material))
        self._inflight[key] = task

        def done(finished: asyncio.Task[Minted]) -> None:
            if self._inflight.get(key) is finished:
                del self._inflight[key]
            if not finished.cancelled():
                finished.exception()  # retrieved: a background refresh's failure is not an error

        task.add_done_callback(done)
        return task

    async def _mint(self, key: SecretKey, material: Material) -> Minted:
        entry = self._entries.setdefault(key, _Entry())
        try:
            document = material.document
            if isinstance(document, OAuth2Refresh):
                minted = await self._refresh(key, material, document, entry)
            elif isinstance(document, OAuth2ClientCredentials):
                minted = await self._client_credentials(document)
            elif isinstance(document, GoogleServiceAccount):
                form = {
                    "grant_type": JWT_BEARER,
                    "assertion": google_assertion(document, self.clock()),
                }
                minted, _ = await self._call(document.token_uri, form, {})
            elif isinstance(document, GitHubApp):
                minted = await self._github_app(document)
            else:
                raise CredentialRefused(f"a {document.kind} secret mints no token")
        except CredentialRefused:
            entry.refused_version = material.version
            raise
        except CredentialUnavailable as exc:
            entry.hold_until, entry.hold_reason = self.clock() + self.hold, str(exc)
            raise
        entry.minted, entry.hold_until = minted, 0.0
        return minted

    async def _client_credentials(self, document: OAuth2ClientCredentials) -> Minted:
        form = {"grant_type": "client_credentials"}
        headers: dict[str, str] = {}
        if document.client_auth == "basic":
            pair = f"{_form(document.client_id)}:{_form(document.client_secret)}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        else:
            form |= {"client_id": document.client_id, "client_secret": document.client_secret}
        if document.scope:
            form["scope"] = document.scope
        if document.audience:
            form["audience"] = document.audience
        minted, _ = await self._call(document.token_url, form, headers)
        return minted

    async def _github_app(self, document: GitHubApp) -> Minted:
        """An installation access token: GitHub answers 201 `{token, expires_at}` (an hour); 401
        (a JWT it does not accept), 403 (a suspended installation), 404 (no such installation or
        app) and 422 are refusals."""
        self.calls += 1
        url = f"{document.api_url.rstrip('/')}/app/installations/{document.installation_id}"
        url += "/access_tokens"
        host = urlsplit(url).hostname or "?"
        headers = {
            "Authorization": "Bearer " + github_app_jwt(document, self.clock()),
            "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": "2022-11-28",
        }
        status, body = await self.dialer.post(url, None, headers)
        if status in (401, 403, 404, 422):
            raise CredentialRefused(f"GitHub at {host} refused the app's token (HTTP {status})")
        if status not in (200, 201) or body is None:
            raise CredentialUnavailable(f"GitHub at {host} answered HTTP {status}")
        token, expires = body.get("token"), body.get("expires_at")
        if not isinstance(token, str) or not token or len(token) > 16384:
            raise CredentialUnavailable(f"GitHub at {host} sent no usable token")
        now = self.clock()
        lifetime = 3600.0
        if isinstance(expires, str):
            with contextlib.suppress(ValueError):  # unparsable: GitHub's documented hour
                lifetime = datetime.fromisoformat(expires.replace("Z", "+00:00")).timestamp() - now
        if lifetime <= 0:
            raise CredentialUnavailable(f"GitHub at {host} sent a token already expired")
        return self._minted(token, now, min(lifetime, 86400))

    async def _refresh(
        self, key: SecretKey, material: Material, document: OAuth2Refresh, entry: _Entry
    ) -> Minted:
        lease = ""
        if self.persister is not None:
            try:
                lease = await self.persister.lease(key, material.version)
            except LeaseBusy:
                return await self._await_other_replica(key, material, entry)
        form = {
            "grant_type": "refresh_token",
            "refresh_token": document.refresh_token,
            "client_id": document.client_id,
        }
        if document.client_secret:
            form["client_secret"] = document.client_secret
        if document.scope:
            form["scope"] = document.scope
        try:
            minted, body = await self._call(document.token_url, form, {})
        except MintError as exc:
            if self.persister is not None:
                refused = isinstance(exc, CredentialRefused)
                try:
                    await self.persister.failure(key, material.version, lease, refused, str(exc))
                except Exception as report:  # the refusal stands; the Console learns next time
                    logger.error("could not report the refresh failure (%s)", type(report).__name__)
            raise
        rotated = body.get("refresh_token") if body else None
        new_document = document.model_copy(
            update={
                "refresh_token": rotated
                if isinstance(rotated, str) and rotated
                else document.refresh_token,
                "access_token": minted.token,
                "expires_at": minted.expires_at,
            }
        )
        version = material.version
        if self.persister is not None:
            try:
                version = await self.persister.commit(
                    key, material.version, lease, new_document.model_dump_json(exclude_none=True)
                )
            except Exception as exc:
                # The endpoint already rotated: this proxy holds the only valid chain, in memory.
                logger.error(
                    "a rotated refresh token for %s could not be written back (%s); kept in "
                    "memory only",
                    key[0],
                    type(exc).__name__,
                )
        entry.chain = Material(new_document, version)
        return minted

    async def _await_other_replica(
        self, key: SecretKey, material: Material, entry: _Entry
    ) -> Minted:
        """Another replica holds the lease (or the Console a newer version): wait, bounded, for
        the newer version to be released to this proxy and use the token it carries."""
        deadline = self.clock() + self.wait
        while self.clock() < deadline:
            await asyncio.sleep(0.1)
            released = self.lookup(key) if self.lookup is not None else None
            if released is not None:
                entry, _ = self._entry(key, released)
            current = entry.chain
            if current is not None and current.version > material.version:
                carried = _carried(current)
                if carried is not None:
                    return carried
                return await self._mint(key, current)
        raise CredentialUnavailable("another replica is refreshing this credential")

    async def _call(
        self, url: str, form: dict[str, str], headers: dict[str, str]
    ) -> tuple[Minted, dict[str, Any] | None]:
        self.calls += 1
        host = urlsplit(url).hostname or "?"
        status, body = await self.dialer.post(url, form, headers)
        error = body.get("error") if body else None
        if status in (401, 403) or (status == 400 and (error in REFUSALS or error is None)):
            code = error if isinstance(error, str) and error in REFUSALS else f"HTTP {status}"
            raise CredentialRefused(f"token endpoint {host} refused the credential ({code})")
        if status != 200 or body is None:
            raise CredentialUnavailable(f"token endpoint {host} answered HTTP {status}")
        token = body.get("access_token")
        if not isinstance(token, str) or not token or len(token) > 16384:
            raise CredentialUnavailable(f"token endpoint {host} sent no usable access_token")
        lifetime = body.get("expires_in", 3600)
        if isinstance(lifetime, str) and lifetime.isdigit():
            lifetime = int(lifetime)
        if not isinstance(lifetime, int) or isinstance(lifetime, bool) or lifetime <= 0:
            lifetime = 3600
        return self._minted(token, self.clock(), min(lifetime, 86400)), body

    def _minted(self, token: str, now: float, lifetime: float) -> Minted:
        # Ahead by `margin`, or by a quarter of a short lifetime.
        return Minted(token, now + lifetime, now + lifetime - min(self.margin, lifetime / 4))


def _carried(material: Material, margin: float = 60.0) -> Minted | None:
    """The access token a rotated document carries (another replica's mint)."""
    document = material.document
    if isinstance(document, OAuth2Refresh) and document.access_token and document.expires_at:
        return Minted(document.access_token, document.expires_at, document.expires_at - margin)
    return None


def _form(value: str) -> str:
    """RFC 6749 §2.3.1: client id and secret are form-urlencoded before Basic."""
    from urllib.parse import quote_plus

    return quote_plus(value)


def minter(
    config: ProxyConfig,
    state: PolicyState,
    resolver: Resolver,
    addresses: Callable[[], AddressPolicy],
    console: httpx.AsyncClient | None,
) -> Minter:
    """The proxy's minter: dials token endpoints like upstreams (the same resolver, address
    policy and upstream trust), writes rotations back when secrets come from the Console."""
    verify: ssl.SSLContext | bool = True
    if config.upstream_ca is not None:
        verify = ssl.create_default_context(cafile=str(config.upstream_ca))
    persister = None
    if config.secrets_from_console and console is not None and config.console_url:
        persister = ConsoleRefresh(console, config.console_url, config.security_cvm_id or "")
    return Minter(
        TokenDialer(resolver, addresses, verify),
        persister,
        lookup=lambda key: state.secrets.material_of(key),
    )
