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
