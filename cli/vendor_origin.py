"""The stand-in model API answering as the agents' own hosts, for `umbra connect` end to end
(docs/specs/embedded.md, "Agent logins against stand-ins"): opt-in, tests only.

Served on one TLS listener (`--vendor-listen ADDR:443`, the name from the Host header):
- `api.anthropic.com`: Anthropic Messages as `cli/llm_origin.py` answers them, but only with the
  subscription's `Authorization: Bearer <token>` (its SHA-256 given) and **no** `x-api-key`: a
  request carrying an API key is refused (401), as a subscription login must not be shadowed.
- `auth.openai.com`: `POST /oauth/token`, the refresh grant, ChatGPT-style: every use answers a
  new refresh token and voids the used one; a spent one is refused (`invalid_grant`, counted).
- `chatgpt.com`: Codex's ChatGPT backend (`/backend-api/codex/responses`, streamed Responses
  over HTTPS, its body zstd-compressed or not, and over the Responses WebSocket;
  `/backend-api/wham/accounts/check`, the workspace routing discovery;
  `/backend-api/wham/settings/user`), only with an access token the token endpoint minted and
  that has not expired.
- `/_umbra/state` (GET) and `/_umbra/codex-login` (POST, a new chain as `codex login` would leave
  in `auth.json`): for the test, which dials the listener directly; no profile allows `/_umbra/`.
Nothing logged, no token echoed; the state says only counts and digests.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from umbra.cli import llm_origin, ws_frames
from umbra.cli.llm_origin import Api, OriginConfig, OriginServer
from umbra.cli.ws_frames import Opcode

ANTHROPIC = "api.anthropic.com"
OPENAI_AUTH = "auth.openai.com"
CHATGPT = "chatgpt.com"
CODEX_CLIENT_ID = "app_umbra_standin"
ACCOUNT_ID = "acct-umbra-standin"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unsigned_jwt(claims: dict[str, Any], signature: str = "stand-in") -> str:
    """A JWT Codex can parse (it reads the claims, it does not verify the signature)."""
    header = _b64(json.dumps({"alg": "none", "typ": "JWT"}).encode())
    return f"{header}.{_b64(json.dumps(claims).encode())}.{signature}"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class VendorState:
    claude_oauth_sha256: str
    access_ttl: int = 8  # short: the Security CVM refreshes (and rotates) between agent runs
    lock: threading.Lock = field(default_factory=threading.Lock)
    refresh: str | None = None  # the one valid refresh token of the chain
    spent: set[str] = field(default_factory=set)
    access: dict[str, float] = field(default_factory=dict)  # access token -> expiry
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, name: str) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + 1

    def mint(self) -> tuple[str, str]:
        """A new access token and the chain's next refresh token (the old one voided)."""
        access = unsigned_jwt({"exp": int(time.time()) + self.access_ttl,
                               "jti": secrets.token_hex(12)}, secrets.token_urlsafe(16))  # fmt: skip
        refresh = "rt-standin-" + secrets.token_urlsafe(24)
        with self.lock:
            if self.refresh is not None:
                self.spent.add(self.refresh)
            self.refresh = refresh
            self.access[access] = time.time() + self.access_ttl
        return access, refresh

    def login(self) -> dict[str, Any]:
        """What `codex login` leaves in `auth.json` after a ChatGPT sign-in (a new chain)."""
        access, refresh = self.mint()
        id_token = unsigned_jwt({
            "aud": [CODEX_CLIENT_ID], "email": "developer@umbra.local",
            "exp": int(time.time()) + 3600,
            "https://api.openai.com/auth": {"chatgpt_account_id": ACCOUNT_ID,
                                            "chatgpt_plan_type": "plus"},
        })  # fmt: skip
        return {"OPENAI_API_KEY": None, "last_refresh": time.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "tokens": {"id_token": id_token, "access_token": access,
                           "refresh_token": refresh, "account_id": ACCOUNT_ID}}  # fmt: skip

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"counts": dict(self.counts), "spent": len(self.spent),
                    "refresh_sha256": _sha(self.refresh) if self.refresh else None}  # fmt: skip


class VendorHandler(llm_origin.Handler):
    server: VendorServer
    _over_websocket = False  # inside `_websocket`: events go out as WebSocket messages

    def _host(self) -> str:
        return (self.headers.get("host") or "").split(":")[0].lower()

    def _bearer(self) -> str:
        auth = self.headers.get("authorization") or ""
        return auth[7:] if auth.lower().startswith("bearer ") else ""

    def _key_ok(self, api: Api) -> bool:
        state = self.server.vendor
        token = self._bearer()
        if self._host() == ANTHROPIC:
            if self.headers.get("x-api-key") is not None:
                state.count("anthropic_x_api_key")
                return False
            ok = bool(token) and hmac.compare_digest(_sha(token), state.claude_oauth_sha256)
        else:
            with state.lock:
                ok = state.access.get(token, 0) > time.time()
        state.count(f"{self._host()}_{'ok' if ok else 'refused'}")
        return ok

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        if path == "/_umbra/state":
            self._json(200, self.server.vendor.snapshot())
            return
        upgrade = (self.headers.get("upgrade") or "").lower() == "websocket"
        if self._host() == CHATGPT and path == "/backend-api/codex/responses" and upgrade:
            if not self._key_ok(Api.OPENAI):  # the handshake carries the token, as a call does
                self._unauthorized(Api.OPENAI)
            else:
                self.server.vendor.count("codex_websocket")
                self._websocket()
            return
        if self._host() == CHATGPT and path.startswith("/backend-api/wham/"):
            if not self._key_ok(Api.OPENAI):
                self._unauthorized(Api.OPENAI)
            elif path.endswith("/accounts/check"):
                self.server.vendor.count("accounts_check")
                self._json(200, _accounts_check())
            else:
                self._json(200, {})
            return
        super().do_GET()

    def do_POST(self) -> None:
        path = self.path.partition("?")[0]
        host = self._host()
        if path == "/_umbra/codex-login":
            self._json(200, self.server.vendor.login())
        elif host == OPENAI_AUTH and path == "/oauth/token":
            self._token()
        elif host == CHATGPT and path == "/backend-api/codex/responses":
            self.path = "/v1/responses"
            super().do_POST()
        elif host == ANTHROPIC:
            super().do_POST()
        else:
            self._json(404, {"error": {"type": "not_found_error", "message": "no such route"}})

    def _responses(self, body: dict[str, Any], stream: bool) -> None:
        if self._host() == CHATGPT:  # a turn with a live minted token (checked before)
            self.server.vendor.count("codex_turn")
        super()._responses(body, stream)

    def _websocket(self) -> None:
        """Codex's Responses WebSocket (its first choice with a ChatGPT login): each
        `response.create` message answered by the same events as the HTTPS stream, one text
        message each. No extension is negotiated, so Codex sends plain text."""
        self.send_response(101)
        self.send_header("upgrade", "websocket")
        self.send_header("connection", "Upgrade")
        self.send_header(
            "sec-websocket-accept", ws_frames.accept_key(self.headers["sec-websocket-key"] or "")
        )
        self.end_headers()
        self.close_connection = True
        self._over_websocket = True
        try:
            while (message := ws_frames.read_message(self.rfile)).opcode is not Opcode.CLOSE:
                if message.opcode is Opcode.PING:
                    self.wfile.write(ws_frames.frame(Opcode.PONG, message.payload))
                elif message.opcode is Opcode.TEXT:
                    body = json.loads(message.payload)
                    if isinstance(body, dict) and body.get("type") == "response.create":
                        self.server.vendor.count("codex_turn_websocket")
                        self._responses(body, True)
            self.wfile.write(ws_frames.frame(Opcode.CLOSE, message.payload[:2]))
        except (EOFError, ws_frames.FrameError, OSError, ValueError):
            pass  # the client went away or sent what Codex does not: the connection ends
        finally:
            self._over_websocket = False

    def _start_events(self) -> None:
        if not self._over_websocket:
            super()._start_events()

    def _event(self, name: str | None, data: object) -> None:
        if not self._over_websocket:
            super()._event(name, data)
            return
        text = data if isinstance(data, str) else json.dumps(data)
        self.wfile.write(ws_frames.frame(Opcode.TEXT, text.encode()))
        self.wfile.flush()

    def _end_events(self) -> None:
        if not self._over_websocket:
            super()._end_events()

    def _token(self) -> None:
        length = min(int(self.headers.get("content-length") or 0), llm_origin.MAX_BODY)
        raw = self.rfile.read(length).decode(errors="replace")
        try:
            form = json.loads(raw) if raw.lstrip().startswith("{") else dict(parse_qsl(raw))
        except ValueError:
            form = {}
        state = self.server.vendor
        presented = str(form.get("refresh_token") or "")
        with state.lock:
            current = state.refresh
            reused = presented in state.spent
        valid = (form.get("grant_type") == "refresh_token" and current is not None
                 and form.get("client_id") == CODEX_CLIENT_ID
                 and hmac.compare_digest(presented, current))  # fmt: skip
        if not valid:
            state.count("refresh_reused" if reused else "refresh_refused")
            self._json(400, {"error": "invalid_grant",
                             "error_description": "refresh token not valid"})  # fmt: skip
            return
        access, refresh = state.mint()
        state.count("refresh_ok")
        self._json(200, {"access_token": access, "refresh_token": refresh,
                         "id_token": unsigned_jwt({"aud": [CODEX_CLIENT_ID]}),
                         "token_type": "Bearer", "expires_in": state.access_ttl})  # fmt: skip


def _accounts_check() -> dict[str, Any]:
    """Codex's workspace-routing discovery (0.171): the one personal account, routed to the
    ChatGPT backend it already uses."""
    account = {"id": ACCOUNT_ID, "plan_type": "plus", "structure": "personal",
               "is_deactivated": False, "can_access_with_session": True,
               "workspace_backend_origin": f"https://{CHATGPT}",
               "account_routing_override": "NO_CONSTRAINT"}  # fmt: skip
    return {"accounts": [account], "account_ordering": [ACCOUNT_ID],
            "default_account_id": ACCOUNT_ID}  # fmt: skip


class VendorServer(OriginServer):
    def __init__(self, address: tuple[str, int], config: OriginConfig, vendor: VendorState):
        super().__init__(address, config)
        self.vendor = vendor
        self.RequestHandlerClass = VendorHandler


def serve_vendor(
    vendor: VendorState, cert: str, key: str, host: str, port: int, reply: str = llm_origin.REPLY
) -> VendorServer:
    """A TLS listener on `host:port` (0: any free port); the caller runs `serve_forever`."""
    import ssl

    server = VendorServer((host, port), OriginConfig({}, reply=reply), vendor)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(
        server.socket, server_side=True, do_handshake_on_connect=False
    )
    return server
