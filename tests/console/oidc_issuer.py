"""A real OIDC issuer for the tests: discovery and JWKS over HTTP on loopback, tokens signed with
joserfc. Keys can be rotated; the Console must pick up the new key by refetching the JWKS."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit

from joserfc import jwt
from joserfc.jwk import ECKey, RSAKey

AUDIENCE = "umbra-console"


class LocalIssuer:
    def __init__(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._keys: list[RSAKey] = []
        self._generation = 0
        self.jwks_fetches = 0
        # While set, every request hangs (a stalled identity provider).
        self.stall = threading.Event()
        # When set, discovery offers an RFC 8628 device flow that logs in as (subject, roles);
        # the first poll answers authorization_pending, like a user who has not approved yet.
        self.device_grant: tuple[str, list[str]] | None = None
        self.device_polls = 0
        # Refresh tokens handed out with device grants (RFC 6749 §6); revoke one to expire it.
        self.refresh_tokens: dict[str, tuple[str, list[str]]] = {}
        self.refreshes = 0
        self.device_expires_in = 600
        # Access tokens' lifetime (s): a walkthrough of emulated boots outlives the default.
        self.token_lifetime = 600
        # When set, /authorize approves at once as (subject, roles) and redirects back with a code
        # bound to the PKCE challenge (RFC 7636 S256); /token redeems a code once.
        self.browser_grant: tuple[str, list[str]] | None = None
        self._codes: dict[str, dict[str, Any]] = {}
        self.rotate(keep_old=False)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def rotate(self, *, keep_old: bool = True) -> None:
        self._generation += 1
        key = RSAKey.generate_key(2048, parameters={"kid": f"k{self._generation}", "use": "sig"})
        self._keys = [key, *self._keys[:1]] if keep_old else [key]

    @property
    def signing_key(self) -> RSAKey:
        return self._keys[0]

    def jwks(self) -> dict[str, Any]:
        return {"keys": [key.as_dict(private=False) for key in self._keys]}

    def token(
        self,
        subject: str,
        roles: list[str] | None = None,
        *,
        key: RSAKey | ECKey | None = None,
        alg: str = "RS256",
        kid: str | None = None,
        **claims: Any,
    ) -> str:
        now = int(time.time())
        body: dict[str, Any] = {
            "iss": self.url,
            "aud": AUDIENCE,
            "sub": subject,
            "iat": now,
            "exp": now + self.token_lifetime,
            "umbra_roles": roles or [],
        }
        body.update(claims)
        signer = key or self.signing_key
        header = {"alg": alg, "kid": kid or signer.kid}
        return jwt.encode(header, body, signer)

    def _authorize(self, handler: BaseHTTPRequestHandler) -> None:
        query = {k: v[-1] for k, v in parse_qs(urlsplit(handler.path).query).items()}
        if (
            self.browser_grant is None
            or query.get("response_type") != "code"
            or query.get("code_challenge_method") != "S256"
            or not query.get("code_challenge")
            or not query.get("redirect_uri")
        ):
            handler.send_error(400)
            return
        code = secrets.token_urlsafe(16)
        self._codes[code] = {
            "grant": self.browser_grant,
            "challenge": query["code_challenge"],
            "redirect_uri": query["redirect_uri"],
            "client_id": query.get("client_id"),
        }
        target = (
            query["redirect_uri"] + "?" + urlencode({"code": code, "state": query.get("state", "")})
        )
        handler.send_response(302)
        handler.send_header("Location", target)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    def _redeem(self, form: dict[str, str]) -> tuple[int, dict[str, Any]]:
        pending = self._codes.pop(form.get("code", ""), None)
        if pending is None:
            return 400, {"error": "invalid_grant"}
        verifier = form.get("code_verifier", "")
        digest = hashlib.sha256(verifier.encode()).digest()
        challenge = base64.urlsafe_b64encode(digest).decode().rstrip("=")
        if (
            challenge != pending["challenge"]
            or form.get("redirect_uri") != pending["redirect_uri"]
            or form.get("client_id") != pending["client_id"]
        ):
            return 400, {"error": "invalid_grant"}
        subject, roles = pending["grant"]
        return 200, {"access_token": self.token(subject, roles), "token_type": "Bearer"}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                while issuer.stall.is_set():
                    time.sleep(0.05)
                if self.path == "/.well-known/openid-configuration":
                    body = {
                        "issuer": issuer.url,
                        "jwks_uri": issuer.url + "/jwks",
                        "id_token_signing_alg_values_supported": ["RS256"],
                    }
                    if issuer.device_grant is not None:
                        body["device_authorization_endpoint"] = issuer.url + "/device"
                        body["token_endpoint"] = issuer.url + "/token"
                    if issuer.browser_grant is not None:
                        body["authorization_endpoint"] = issuer.url + "/authorize"
                        body["token_endpoint"] = issuer.url + "/token"
                elif self.path.startswith("/authorize?"):
                    issuer._authorize(self)
                    return
                elif self.path == "/jwks":
                    issuer.jwks_fetches += 1
                    body = issuer.jwks()
                else:
                    self.send_error(404)
                    return
                raw = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_POST(self) -> None:
                raw_form = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                form = dict(parse_qsl(raw_form.decode()))
                status, body = 200, {}
                if self.path == "/token" and form.get("grant_type") == "authorization_code":
                    self._answer(*issuer._redeem(form))
                    return
                if self.path == "/token" and form.get("grant_type") == "refresh_token":
                    issuer.refreshes += 1
                    who = issuer.refresh_tokens.get(form.get("refresh_token", ""))
                    if who is None:
                        status, body = 400, {"error": "invalid_grant"}
                    else:
                        body = {
                            "access_token": issuer.token(*who),
                            "token_type": "Bearer",
                            "expires_in": issuer.device_expires_in,
                        }
                    self._answer(status, body)
                    return
                if issuer.device_grant is None:
                    self.send_error(404)
                    return
                if self.path == "/device":
                    body = {
                        "device_code": "dc-1",
                        "user_code": "WDJB-MJHT",
                        "verification_uri": issuer.url + "/activate",
                        "expires_in": 60,
                        "interval": 0,
                    }
                elif self.path == "/token":
                    issuer.device_polls += 1
                    if issuer.device_polls == 1:
                        status, body = 400, {"error": "authorization_pending"}
                    else:
                        subject, roles = issuer.device_grant
                        refresh = f"rt-{len(issuer.refresh_tokens) + 1}"
                        issuer.refresh_tokens[refresh] = (subject, roles)
                        body = {
                            "access_token": issuer.token(subject, roles),
                            "token_type": "Bearer",
                            "expires_in": issuer.device_expires_in,
                            "refresh_token": refresh,
                        }
                else:
                    self.send_error(404)
                    return
                self._answer(status, body)

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler
