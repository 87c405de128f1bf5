"""A real OIDC issuer for the tests: discovery and JWKS over HTTP on loopback, tokens signed with
joserfc. Keys can be rotated; the Console must pick up the new key by refetching the JWKS."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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
            "exp": now + 600,
            "umbra_roles": roles or [],
        }
        body.update(claims)
        signer = key or self.signing_key
        header = {"alg": alg, "kid": kid or signer.kid}
        return jwt.encode(header, body, signer)

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
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                status, body = 200, {}
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
                        body = {
                            "access_token": issuer.token(subject, roles),
                            "token_type": "Bearer",
                        }
                else:
                    self.send_error(404)
                    return
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler
