"""DEVELOPMENT ONLY: a local OIDC issuer for `umbra up`, the one-machine embedded mode.

It knows exactly one user (the person at this machine) and approves every login of that user
without asking: RFC 8628 device grants are approved as soon as they are requested, authorization
code requests (PKCE S256 required) redirect straight back with a code. That is only acceptable
because it listens on loopback, for a Console that runs on the same machine in embedded mode.

Its discovery document carries `"umbra_development_issuer": true`; the Console refuses such an
issuer unless `embedded_dev` is set, which in turn it accepts only with SQLite and a loopback
issuer (`console/config.py`), so no production setting can enable it.

Offers: discovery, JWKS, device authorization + token (device_code, authorization_code + PKCE,
refresh_token grants), authorize. Signing key and refresh tokens persist in the state directory.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from joserfc import jwt
from joserfc.jwk import RSAKey

from umbra.contracts.files import write_atomic

DEV_ISSUER_MARKER = "umbra_development_issuer"
AUDIENCE = "umbra-console"
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
ACCESS_TTL = 8 * 3600
CODE_TTL = 120


class DevIssuerError(Exception):
    pass


@dataclass
class DevIssuer:
    """State of the development issuer: one user, its roles, a persistent signing key."""

    state_dir: Path
    subject: str
    roles: list[str]
    url: str = ""
    key: RSAKey = field(init=False)
    _pending: dict[str, dict[str, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        key_file = self.state_dir / "dev-issuer-key.json"
        if key_file.exists():
            self.key = RSAKey.import_key(json.loads(key_file.read_text()))
        else:
            self.key = RSAKey.generate_key(2048, parameters={"kid": "dev1", "use": "sig"})
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(self.key.as_dict(private=True)))

    # -- documents ----------------------------------------------------------------------------
    def discovery(self) -> dict[str, Any]:
        return {
            "issuer": self.url,
            "jwks_uri": self.url + "/jwks",
            "authorization_endpoint": self.url + "/authorize",
            "token_endpoint": self.url + "/token",
            "device_authorization_endpoint": self.url + "/device",
            "response_types_supported": ["code"],
            "grant_types_supported": ["authorization_code", "refresh_token", DEVICE_GRANT],
            "code_challenge_methods_supported": ["S256"],
            "id_token_signing_alg_values_supported": ["RS256"],
            "subject_types_supported": ["public"],
            DEV_ISSUER_MARKER: True,
        }

    def jwks(self) -> dict[str, Any]:
        return {"keys": [self.key.as_dict(private=False)]}

    def _tokens(self, client_id: str) -> dict[str, Any]:
        now = int(time.time())
        claims = {
            "iss": self.url,
            "aud": AUDIENCE,
            "sub": self.subject,
            "iat": now,
            "exp": now + ACCESS_TTL,
            "umbra_roles": self.roles,
            "azp": client_id,
        }
        access = jwt.encode({"alg": "RS256", "kid": self.key.kid}, claims, self.key)
        refresh = secrets.token_urlsafe(32)
        self._store_refresh(refresh, client_id)
        return {
            "access_token": access,
            "id_token": access,
            "token_type": "Bearer",
            "expires_in": ACCESS_TTL,
            "refresh_token": refresh,
        }

    def _refresh_file(self) -> Path:
        return self.state_dir / "dev-issuer-refresh.json"

    def _store_refresh(self, token: str, client_id: str) -> None:
        path = self._refresh_file()
        known = json.loads(path.read_text()) if path.exists() else {}
        known[hashlib.sha256(token.encode()).hexdigest()] = client_id
        write_atomic(path, json.dumps(known), 0o600)

    def _take_refresh(self, token: str) -> str | None:
        """Refresh tokens rotate: each is good once."""
        path = self._refresh_file()
        known = json.loads(path.read_text()) if path.exists() else {}
        client_id: str | None = known.pop(hashlib.sha256(token.encode()).hexdigest(), None)
        path.write_text(json.dumps(known))
        return client_id

    # -- grants -------------------------------------------------------------------------------
    def device_authorization(self, form: dict[str, str]) -> dict[str, Any]:
        device_code = secrets.token_urlsafe(24)
        with self._lock:
            self._pending[device_code] = {
                "kind": "device",
                "client_id": form.get("client_id", "umbra-cli"),
                "expires": time.time() + 600,
            }
        return {
            "device_code": device_code,
            "user_code": "LOCAL-DEV",
            "verification_uri": self.url + "/activate",
            "verification_uri_complete": self.url + "/activate?user_code=LOCAL-DEV",
            "expires_in": 600,
            "interval": 0,
        }

    def authorize(self, query: dict[str, str]) -> str:
        """The redirect for an authorization request: auto-approved, PKCE S256 required."""
        redirect = query.get("redirect_uri", "")
        host = urlsplit(redirect).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise DevIssuerError("redirect_uri must be a loopback URL in development mode")
        if query.get("response_type") != "code":
            raise DevIssuerError("response_type must be code")
        if query.get("code_challenge_method") != "S256" or not query.get("code_challenge"):
            raise DevIssuerError("PKCE with code_challenge_method=S256 is required")
        code = secrets.token_urlsafe(24)
        with self._lock:
            self._pending[code] = {
                "kind": "code",
                "client_id": query.get("client_id", ""),
                "redirect_uri": redirect,
                "challenge": query["code_challenge"],
                "expires": time.time() + CODE_TTL,
            }
        params = {"code": code}
        if "state" in query:
            params["state"] = query["state"]
        return redirect + ("&" if "?" in redirect else "?") + urlencode(params)

    def token(self, form: dict[str, str]) -> tuple[int, dict[str, Any]]:
        grant = form.get("grant_type")
        if grant == DEVICE_GRANT:
            with self._lock:
                pending = self._pending.pop(form.get("device_code", ""), None)
            if pending is None or pending["kind"] != "device" or pending["expires"] < time.time():
                return 400, {"error": "expired_token"}
            return 200, self._tokens(pending["client_id"])
        if grant == "authorization_code":
            with self._lock:
                pending = self._pending.pop(form.get("code", ""), None)
            if pending is None or pending["kind"] != "code" or pending["expires"] < time.time():
                return 400, {"error": "invalid_grant"}
            if form.get("redirect_uri") != pending["redirect_uri"]:
                return 400, {"error": "invalid_grant", "error_description": "redirect_uri"}
            verifier = form.get("code_verifier", "")
            digest = hashlib.sha256(verifier.encode()).digest()
            challenge = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
            if not secrets.compare_digest(challenge, pending["challenge"]):
                return 400, {"error": "invalid_grant", "error_description": "PKCE"}
            return 200, self._tokens(pending["client_id"])
        if grant == "refresh_token":
            with self._lock:
                client_id = self._take_refresh(form.get("refresh_token", ""))
            if client_id is None:
                return 400, {"error": "invalid_grant"}
            return 200, self._tokens(client_id)
        return 400, {"error": "unsupported_grant_type"}


def _handler(issuer: DevIssuer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict[str, Any]) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Cache-Control", "no-store")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            if path == "/.well-known/openid-configuration":
                self._send(200, issuer.discovery())
            elif path == "/jwks":
                self._send(200, issuer.jwks())
            elif path == "/healthz":
                self._send(200, {"ok": True})
            elif path == "/authorize":
                params = {k: v[0] for k, v in parse_qs(query).items()}
                try:
                    location = issuer.authorize(params)
                except DevIssuerError as exc:
                    self._send(400, {"error": "invalid_request", "error_description": str(exc)})
                    return
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self._send(404, {"error": "not_found"})

        def do_POST(self) -> None:
            length = min(int(self.headers.get("Content-Length", "0") or 0), 65536)
            form = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}
            if self.path == "/device":
                self._send(200, issuer.device_authorization(form))
            elif self.path == "/token":
                self._send(*issuer.token(form))
            else:
                self._send(404, {"error": "not_found"})

        def log_message(self, format: str, *args: Any) -> None:
            pass  # requests carry codes and tokens: nothing is logged

    return Handler


def serve(state_dir: Path, subject: str, roles: list[str], host: str, port: int) -> None:
    """Serve until killed (`umbra up` supervises it)."""
    if host not in ("127.0.0.1", "::1", "localhost"):
        raise DevIssuerError("the development issuer listens on loopback only")
    issuer = DevIssuer(state_dir, subject, roles)
    server = ThreadingHTTPServer((host, port), _handler(issuer))
    issuer.url = f"http://{host}:{server.server_address[1]}"
    server.serve_forever()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="DEVELOPMENT ONLY local OIDC issuer (umbra up).")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--subject", required=True)
    parser.add_argument("--role", action="append", default=[])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    serve(args.state_dir, args.subject, args.role, args.host, args.port)


if __name__ == "__main__":
    main()
