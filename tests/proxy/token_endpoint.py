"""A local OAuth 2.0 token endpoint that checks what it receives, mounted as a route of a test
origin (`OriginServer.routes[host] = endpoint.handle`).

- refresh_token grant, ChatGPT/Codex-style: every use answers a new refresh token and voids the old
  one; a spent token is refused (`invalid_grant`) and, like OpenAI's, revokes the whole chain.
- client_credentials: the client id and secret, by HTTP Basic or in the form.
- JWT bearer (RFC 7523, Google service accounts): the RS256 assertion verified with the account's
  public key, its issuer, audience and lifetime checked.
Access tokens are random and remembered, so an API route can check a Bearer it was sent
(`valid`). `delay` slows every answer; `down` answers 503; `revoke()` ends the chain.
"""

from __future__ import annotations

import base64
import json
import secrets
import threading
import time
from typing import Any
from urllib.parse import parse_qsl, unquote_plus, urlsplit

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from tests.proxy.harness import OriginHandler, Seen

GOOGLE_TOKEN_URL = "https://oauth2.googleapis.com/token"


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TokenEndpoint:
    def __init__(self, token_url: str, *, expires_in: int = 3600) -> None:
        self.token_url = token_url
        self.expires_in = expires_in
        self.lock = threading.Lock()
        self.clients: dict[str, str] = {}  # client id -> secret
        self.current_refresh: dict[str, str] = {}  # client id -> the one valid refresh token
        self.spent: set[str] = set()
        self.accounts: dict[str, rsa.RSAPublicKey] = {}  # service-account email -> key
        self.issued: dict[str, float] = {}  # access token -> expiry
        self.calls: dict[str, int] = {}
        self.refused = 0
        self.delay = 0.0
        self.down = False

    # -- setup --------------------------------------------------------------------------------
    def register_client(self, client_id: str, secret: str = "") -> None:
        self.clients[client_id] = secret

    def start_chain(self, client_id: str) -> str:
        token = "rt-" + secrets.token_hex(16)
        with self.lock:
            self.current_refresh[client_id] = token
        return token

    def register_account(self, email: str, key: rsa.RSAPublicKey) -> None:
        self.accounts[email] = key

    def revoke(self, client_id: str) -> None:
        with self.lock:
            self.current_refresh.pop(client_id, None)

    def valid(self, token: str) -> bool:
        with self.lock:
            return self.issued.get(token, 0) > time.time()

    def chain(self, client_id: str) -> str | None:
        with self.lock:
            return self.current_refresh.get(client_id)

    # -- the endpoint -------------------------------------------------------------------------
    def handle(self, handler: OriginHandler, seen: Seen) -> None:
        if self.delay:
            time.sleep(self.delay)
        if self.down:
            handler.send(503, b"down for maintenance")
            return
        if seen.method != "POST" or seen.path != urlsplit(self.token_url).path:
            handler.send(404, b"")
            return
        form = dict(parse_qsl(seen.body.decode(), keep_blank_values=True))
        grant = form.get("grant_type", "")
        with self.lock:
            self.calls[grant] = self.calls.get(grant, 0) + 1
        answer = self._grant(grant, form, " ".join(seen.header("authorization")))
        if "error" in answer:
            with self.lock:
                self.refused += 1
            handler.send(400, json.dumps(answer).encode(), {"content-type": "application/json"})
            return
        handler.send(200, json.dumps(answer).encode(), {"content-type": "application/json"})

    def _issue(self, **extra: str) -> dict[str, Any]:
        token = "at-" + secrets.token_hex(20)
        with self.lock:
            self.issued[token] = time.time() + self.expires_in
        return {
            "access_token": token,
            "token_type": "Bearer",
            "expires_in": self.expires_in,
        } | extra

    def _grant(self, grant: str, form: dict[str, str], authorization: str) -> dict[str, Any]:
        if grant == "refresh_token":
            client_id, presented = form.get("client_id", ""), form.get("refresh_token", "")
            with self.lock:
                current = self.current_refresh.get(client_id)
                if current is None or presented != current:
                    if presented in self.spent:  # replay of a spent token: revoke the chain
                        self.current_refresh.pop(client_id, None)
                    return {"error": "invalid_grant", "error_description": "refresh token reused"}
                self.spent.add(presented)
                rotated = "rt-" + secrets.token_hex(16)
                self.current_refresh[client_id] = rotated
            return self._issue(refresh_token=rotated)
        if grant == "client_credentials":
            if authorization.startswith("Basic "):
                pair = base64.b64decode(authorization[6:]).decode()
                client_id, _, secret = (unquote_plus(part) for part in pair.partition(":"))
            else:
                client_id, secret = form.get("client_id", ""), form.get("client_secret", "")
            if client_id not in self.clients or self.clients[client_id] != secret:
                return {"error": "invalid_client"}
            return self._issue()
        if grant == "urn:ietf:params:oauth:grant-type:jwt-bearer":
            return self._jwt(form.get("assertion", ""))
        return {"error": "unsupported_grant_type"}

    def _jwt(self, assertion: str) -> dict[str, Any]:
        try:
            head, body, signature = assertion.split(".")
            header, claims = json.loads(_unb64(head)), json.loads(_unb64(body))
            key = self.accounts[claims["iss"]]
            key.verify(
                _unb64(signature), f"{head}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256()
            )
        except (ValueError, KeyError, InvalidSignature):
            return {"error": "invalid_grant", "error_description": "bad assertion"}
        now = time.time()
        if (
            header.get("alg") != "RS256"
            # google-auth always names Google's token URL; the proxy names the one it calls.
            or claims.get("aud") not in (self.token_url, GOOGLE_TOKEN_URL)
            or not claims.get("iat", 0) - 60 <= now <= claims.get("exp", 0)
            or claims.get("exp", 0) - claims.get("iat", 0) > 3600
        ):
            return {"error": "invalid_grant", "error_description": "bad claims"}
        return self._issue()


class GitHubAppEndpoint:
    """GitHub's installation-token exchange (`POST /app/installations/{id}/access_tokens`) as
    GitHub checks it: `Authorization: Bearer <JWT>`, RS256, verified with the app's public key,
    `iss` = the app id, `iat` not in the future (60 s drift allowed), `exp` after now and at most
    10 min after `iat`... and the API behind it, which answers 200 only to
    `Authorization: Bearer <a live installation token>` or git's `Basic x-access-token:<token>`.
    An unknown installation is 404, a bad JWT 401 (as GitHub answers)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.apps: dict[str, rsa.RSAPublicKey] = {}  # app id -> public key
        self.installations: dict[int, str] = {}  # installation id -> app id
        self.issued: dict[str, float] = {}  # installation token -> expiry
        self.exchanges = 0
        self.refused = 0
        self.headers: list[dict[str, str]] = []

    def register(self, app_id: int, installation_id: int, key: rsa.RSAPublicKey) -> None:
        self.apps[str(app_id)] = key
        self.installations[installation_id] = str(app_id)

    def valid(self, token: str) -> bool:
        with self.lock:
            return self.issued.get(token, 0) > time.time()

    def handle(self, handler: OriginHandler, seen: Seen) -> None:
        parts = seen.path.strip("/").split("/")
        if seen.method == "POST" and len(parts) == 4 and parts[:2] == ["app", "installations"]:
            self._exchange(handler, seen, parts[2])
            return
        auth = " ".join(seen.header("authorization"))
        token = ""
        if auth.startswith("Bearer "):
            token = auth.removeprefix("Bearer ")
        elif auth.startswith("Basic "):
            user, _, token = base64.b64decode(auth[6:]).decode().partition(":")
            token = token if user == "x-access-token" else ""
        ok = bool(token) and self.valid(token)
        handler.send(200 if ok else 401, b"github ok\n" if ok else b"Bad credentials\n")

    def _exchange(self, handler: OriginHandler, seen: Seen, installation: str) -> None:
        with self.lock:
            self.exchanges += 1
            self.headers.append({k: " ".join(seen.header(k)) for k in ("accept",)})
        status, answer = self._check(" ".join(seen.header("authorization")), installation)
        if status != 201:
            with self.lock:
                self.refused += 1
        handler.send(status, json.dumps(answer).encode(), {"content-type": "application/json"})

    def _check(self, auth: str, installation: str) -> tuple[int, dict[str, Any]]:
        bad = 401, {"message": "A JSON web token could not be decoded"}
        try:
            head, body, signature = auth.removeprefix("Bearer ").split(".")
            header, claims = json.loads(_unb64(head)), json.loads(_unb64(body))
            key = self.apps[str(claims["iss"])]
            key.verify(
                _unb64(signature), f"{head}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256()
            )
        except (ValueError, KeyError, InvalidSignature):
            return bad
        now = time.time()
        iat, exp = claims.get("iat", 0), claims.get("exp", 0)
        if (
            not auth.startswith("Bearer ")
            or header.get("alg") != "RS256"
            or not iat - 60 <= now < exp
            or exp - iat > 600
        ):
            return bad
        app = self.installations.get(int(installation)) if installation.isdigit() else None
        if app != str(claims["iss"]):
            return 404, {"message": "Not Found"}
        token = "ghs_" + secrets.token_hex(18)
        expires = now + 3600
        with self.lock:
            self.issued[token] = expires
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))
        return 201, {"token": token, "expires_at": stamp, "permissions": {"contents": "read"}}
