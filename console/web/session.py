"""Signed browser sessions and CSRF tokens for the web view.

A session is a cookie holding `base64(JSON) . HMAC-SHA256`: the subject and roles validated from
the OIDC access token at login, a CSRF token, and an expiry no later than the token's. The key is
random per Console process (`WebKeys`), so a restart logs everyone out and nothing secret is
stored server-side. The cookie is HttpOnly, SameSite=Lax and Secure unless the request came over
plain HTTP to a loopback address (the embedded `umbra up` case).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from ipaddress import ip_address
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from umbra.console.deps import parse_roles
from umbra.console.enums import Role
from umbra.console.services.access import User

SESSION_COOKIE = "umbra_web"
SECURE_SESSION_COOKIE = "__Host-umbra_web"
LOGIN_COOKIE = "umbra_web_login"
SECURE_LOGIN_COOKIE = "__Host-umbra_web_login"
MAX_SESSION_SECONDS = 8 * 3600
LOGIN_SECONDS = 600
MAX_COOKIE_LENGTH = 8192


@dataclass(frozen=True)
class WebSession:
    subject: str
    roles: dict[str, Role]
    csrf: str
    expires: int

    @property
    def user(self) -> User:
        return User(subject=self.subject, roles=self.roles)


class WebKeys:
    """HMAC keys for the session and login cookies (distinct purposes, distinct keys)."""

    def __init__(self, key: bytes | None = None) -> None:
        root = key or secrets.token_bytes(32)
        self._session = hmac.new(root, b"umbra-web-session", hashlib.sha256).digest()
        self._login = hmac.new(root, b"umbra-web-login", hashlib.sha256).digest()

    def seal_session(self, session: WebSession) -> str:
        return _seal(
            self._session,
            {
                "s": session.subject,
                "r": dict(session.roles),
                "c": session.csrf,
                "e": session.expires,
            },
        )

    def open_session(self, value: str | None) -> WebSession | None:
        body = _open(self._session, value)
        if body is None:
            return None
        subject, roles, csrf, expires = body.get("s"), body.get("r"), body.get("c"), body.get("e")
        if (
            not isinstance(subject, str)
            or not isinstance(csrf, str)
            or not isinstance(expires, int)
        ):
            return None
        if not isinstance(roles, dict) or expires < time.time():
            return None
        parsed = parse_roles([f"{team}:{role}" for team, role in roles.items()])
        return WebSession(subject=subject, roles=parsed, csrf=csrf, expires=expires)

    def seal_login(self, state: str, verifier: str, next_path: str) -> str:
        return _seal(
            self._login,
            {"st": state, "v": verifier, "n": next_path, "e": int(time.time()) + LOGIN_SECONDS},
        )

    def open_login(self, value: str | None) -> dict[str, Any] | None:
        body = _open(self._login, value)
        if body is None or not isinstance(body.get("e"), int) or body["e"] < time.time():
            return None
        if not all(isinstance(body.get(key), str) for key in ("st", "v", "n")):
            return None
        return body


def new_session(subject: str, roles: dict[str, Role], token_expires: int) -> WebSession:
    expires = min(int(time.time()) + MAX_SESSION_SECONDS, token_expires)
    return WebSession(subject, roles, secrets.token_urlsafe(32), expires)


def _seal(key: bytes, body: dict[str, Any]) -> str:
    raw = base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode()).rstrip(b"=")
    tag = base64.urlsafe_b64encode(hmac.new(key, raw, hashlib.sha256).digest()).rstrip(b"=")
    return (raw + b"." + tag).decode()


def _open(key: bytes, value: str | None) -> dict[str, Any] | None:
    if not value or len(value) > MAX_COOKIE_LENGTH or value.count(".") != 1:
        return None
    raw, tag = value.encode("ascii", "replace").split(b".")
    expected = base64.urlsafe_b64encode(hmac.new(key, raw, hashlib.sha256).digest()).rstrip(b"=")
    if not hmac.compare_digest(tag, expected):
        return None
    try:
        body = json.loads(base64.urlsafe_b64decode(raw + b"=" * (-len(raw) % 4)))
    except (binascii.Error, ValueError):
        return None
    return body if isinstance(body, dict) else None


def is_loopback_http(request: Request) -> bool:
    """Plain HTTP is only tolerated to a loopback address; anywhere else cookies are Secure."""
    if request.url.scheme != "http":
        return False
    host = request.url.hostname or ""
    if host == "localhost":
        return True
    try:
        return ip_address(host).is_loopback
    except ValueError:
        return False


def cookie_names(request: Request) -> tuple[str, str]:
    if is_loopback_http(request):
        return SESSION_COOKIE, LOGIN_COOKIE
    return SECURE_SESSION_COOKIE, SECURE_LOGIN_COOKIE


def set_cookie(request: Request, response: Response, name: str, value: str, max_age: int) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path="/",
        httponly=True,
        secure=not is_loopback_http(request),
        samesite="lax",
    )


def clear_cookie(request: Request, response: Response, name: str) -> None:
    response.delete_cookie(
        name, path="/", httponly=True, secure=not is_loopback_http(request), samesite="lax"
    )


def csrf_ok(session: WebSession, submitted: str | None) -> bool:
    return submitted is not None and hmac.compare_digest(
        submitted.encode("utf-8", "replace"), session.csrf.encode()
    )
