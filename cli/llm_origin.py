"""A stand-in model API for `umbra up --check` and the agents' end-to-end tests.

It speaks just enough of two wire formats for the real agents to finish a turn:
- Anthropic Messages (`POST /v1/messages`, Claude Code): JSON, or with `"stream": true` the
  server-sent events the real API sends (`message_start`, `content_block_start`, `ping`,
  `content_block_delta`…, `content_block_stop`, `message_delta` with usage, `message_stop`);
  `POST /v1/messages/count_tokens`; `GET /v1/models`.
- OpenAI Responses (`POST /v1/responses`, Codex): JSON, or streamed (`response.created`,
  `response.in_progress`, `response.output_item.added`, `response.content_part.added`,
  `response.output_text.delta`…, `response.output_text.done`, `response.content_part.done`,
  `response.output_item.done`, `response.completed` with usage); and Chat Completions
  (`POST /v1/chat/completions`, streamed as `chat.completion.chunk` events ending `[DONE]`).

Every model call must carry the real API key (Anthropic: `x-api-key`; OpenAI: `Authorization:
Bearer`), which the Security CVM injects: the stand-in knows only its SHA-256 and answers 401
otherwise. It never echoes a header back, and it logs nothing about a request but what `Seen`
keeps (the API, the path, whether the key matched, whether it streamed).

Run: `python -m umbra.cli.llm_origin --cert C --key K --port P --anthropic-key-sha256 H1
--openai-key-sha256 H2` (hashes, so no key is on a command line).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import ssl
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from umbra.proxy.compression import DecodeError, DecodeLimit, content_decode

REPLY = "Hello from the Umbra stand-in model."
MODEL = "umbra-stand-in"
MAX_BODY = 8 << 20


class Api(StrEnum):
    ANTHROPIC = "anthropic"
    OPENAI = "openai"


@dataclass(frozen=True, slots=True)
class Seen:
    api: Api
    method: str
    path: str
    key_ok: bool
    stream: bool


@dataclass
class OriginConfig:
    key_sha256: dict[Api, str]  # hex SHA-256 of the real key each API expects
    reply: str = REPLY
    # Seconds between streamed text pieces (a benchmark may want a visible stream).
    gap: float = 0.0
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, seen: Seen) -> None:
        with self.lock:
            self.seen.append(seen)


def _pieces(text: str) -> list[str]:
    """The reply in a few deltas, as a model streams it (words with their spaces)."""
    words = text.split(" ")
    return [word + (" " if index < len(words) - 1 else "") for index, word in enumerate(words)]


def _usage_tokens(text: str) -> int:
    return max(1, len(text) // 4)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: OriginServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # ------------------------------------------------------------------ plumbing

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("content-length") or 0)
        if length > MAX_BODY:
            raise ValueError("body too large")
        raw = self.rfile.read(length) if length else b""
        encoding = self.headers.get("content-encoding")
        if raw and encoding:
            # Codex with a ChatGPT login sends its turns zstd-compressed, as the real backend
            # accepts (docs/specs/embedded.md, "Agent logins against stand-ins").
            try:
                raw = content_decode(raw, encoding, MAX_BODY)
            except (DecodeError, DecodeLimit) as exc:
                raise ValueError(str(exc)) from None
        if not raw:
            return {}
        document = json.loads(raw)
        return document if isinstance(document, dict) else {}

    def _json(self, status: int, document: object) -> None:
        raw = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _start_events(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

    def _event(self, name: str | None, data: object) -> None:
        text = f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
        if name is not None:
            text = f"event: {name}\n" + text
        raw = text.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(raw), raw))
        self.wfile.flush()

    def _end_events(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _key_ok(self, api: Api) -> bool:
        if api is Api.ANTHROPIC:
            presented = self.headers.get("x-api-key") or ""
        else:
            auth = self.headers.get("authorization") or ""
            presented = auth[7:] if auth.lower().startswith("bearer ") else ""
        expected = self.server.config.key_sha256.get(api, "")
        digest = hashlib.sha256(presented.encode()).hexdigest()
        return bool(presented) and hmac.compare_digest(digest, expected)

    def _deltas(self) -> list[str]:
        return _pieces(self.server.config.reply)

    def _pause(self) -> None:
        if self.server.config.gap:
            time.sleep(self.server.config.gap)

    # ------------------------------------------------------------------ routes

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        if path == "/v1/models":
            api = Api.ANTHROPIC if self.headers.get("x-api-key") else Api.OPENAI
            ok = self._key_ok(api)
            self.server.config.record(Seen(api, "GET", path, ok, False))
            if not ok:
                self._unauthorized(api)
                return
            self._json(200, {"data": [{"id": MODEL, "object": "model", "type": "model"}]})
            return
        self._json(404, {"error": {"type": "not_found_error", "message": "no such route"}})

    def do_POST(self) -> None:
        path = self.path.partition("?")[0]
        routes = {
            "/v1/messages": (Api.ANTHROPIC, self._messages),
            "/v1/messages/count_tokens": (Api.ANTHROPIC, self._count_tokens),
            "/v1/responses": (Api.OPENAI, self._responses),
            "/v1/chat/completions": (Api.OPENAI, self._chat),
        }
        if path not in routes:
            self._json(404, {"error": {"type": "not_found_error", "message": "no such route"}})
            return
        api, answer = routes[path]
        try:
            body = self._body()
        except ValueError:
            self._json(400, {"error": {"type": "invalid_request_error", "message": "bad body"}})
            return
        stream = bool(body.get("stream"))
        ok = self._key_ok(api)
        self.server.config.record(Seen(api, "POST", path, ok, stream))
        if not ok:
            self._unauthorized(api)
            return
        answer(body, stream)

    def _unauthorized(self, api: Api) -> None:
        # Says which header, never what arrived in it.
        header = "x-api-key" if api is Api.ANTHROPIC else "Authorization: Bearer"
        message = f"the stand-in did not receive the real API key in {header}"
        if api is Api.ANTHROPIC:
            error = {"type": "error", "error": {"type": "authentication_error", "message": message}}
        else:
            error = {"error": {"type": "invalid_request_error", "code": "invalid_api_key",
                               "message": message}}  # fmt: skip
        self._json(401, error)

    # ------------------------------------------------------------------ Anthropic

    def _messages(self, body: dict[str, Any], stream: bool) -> None:
        model = str(body.get("model") or MODEL)[:100]
        text = self.server.config.reply
        message_id = f"msg_umbra{time.monotonic_ns():x}"
        usage_in = {"input_tokens": 10, "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0}  # fmt: skip
        if not stream:
            self._json(200, {
                "id": message_id, "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {**usage_in, "output_tokens": _usage_tokens(text)},
            })  # fmt: skip
            return
        self._start_events()
        self._event("message_start", {"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {**usage_in, "output_tokens": 1},
        }})  # fmt: skip
        self._event("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}})  # fmt: skip
        self._event("ping", {"type": "ping"})
        for piece in self._deltas():
            self._pause()
            self._event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                "delta": {"type": "text_delta", "text": piece}})  # fmt: skip
        self._event("content_block_stop", {"type": "content_block_stop", "index": 0})
        self._event("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                      "usage": {"output_tokens": _usage_tokens(text)}})  # fmt: skip
        self._event("message_stop", {"type": "message_stop"})
        self._end_events()

    def _count_tokens(self, body: dict[str, Any], stream: bool) -> None:
        self._json(200, {"input_tokens": 10})

    # ------------------------------------------------------------------ OpenAI

    def _responses(self, body: dict[str, Any], stream: bool) -> None:
        model = str(body.get("model") or MODEL)[:100]
        text = self.server.config.reply
        response_id = f"resp_umbra{time.monotonic_ns():x}"
        item_id = f"msg_umbra{time.monotonic_ns():x}"
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {"id": item_id, "type": "message", "status": "completed", "role": "assistant",
                "content": [part]}  # fmt: skip
        usage = {
            "input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": _usage_tokens(text), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 10 + _usage_tokens(text),
        }  # fmt: skip

        def response(status: str, output: list[object], with_usage: bool) -> dict[str, Any]:
            return {
                "id": response_id, "object": "response", "created_at": int(time.time()),
                "status": status, "model": model, "output": output, "error": None,
                "incomplete_details": None, "usage": usage if with_usage else None,
            }  # fmt: skip

        if not stream:
            self._json(200, response("completed", [item], True))
            return
        self._start_events()
        sequence = 0

        def event(name: str, data: dict[str, Any]) -> None:
            nonlocal sequence
            self._event(name, {"type": name, "sequence_number": sequence, **data})
            sequence += 1

        event("response.created", {"response": response("in_progress", [], False)})
        event("response.in_progress", {"response": response("in_progress", [], False)})
        event("response.output_item.added", {"output_index": 0, "item": {
            **item, "status": "in_progress", "content": []}})  # fmt: skip
        event("response.content_part.added", {"item_id": item_id, "output_index": 0,
              "content_index": 0, "part": {**part, "text": ""}})  # fmt: skip
        for piece in self._deltas():
            self._pause()
            event("response.output_text.delta", {"item_id": item_id, "output_index": 0,
                  "content_index": 0, "delta": piece})  # fmt: skip
        event("response.output_text.done", {"item_id": item_id, "output_index": 0,
              "content_index": 0, "text": text})  # fmt: skip
        event("response.content_part.done", {"item_id": item_id, "output_index": 0,
              "content_index": 0, "part": part})  # fmt: skip
        event("response.output_item.done", {"output_index": 0, "item": item})
        event("response.completed", {"response": response("completed", [item], True)})
        self._end_events()

    def _chat(self, body: dict[str, Any], stream: bool) -> None:
        model = str(body.get("model") or MODEL)[:100]
        text = self.server.config.reply
        chat_id = f"chatcmpl-umbra{time.monotonic_ns():x}"
        created = int(time.time())
        usage = {"prompt_tokens": 10, "completion_tokens": _usage_tokens(text),
                 "total_tokens": 10 + _usage_tokens(text)}  # fmt: skip
        if not stream:
            self._json(200, {
                "id": chat_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}],
                "usage": usage,
            })  # fmt: skip
            return
        self._start_events()

        def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            return {"id": chat_id, "object": "chat.completion.chunk", "created": created,
                    "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip

        self._event(None, chunk({"role": "assistant", "content": ""}, None))
        for piece in self._deltas():
            self._pause()
            self._event(None, chunk({"content": piece}, None))
        self._event(None, {**chunk({}, "stop"), "usage": usage})
        self._event(None, "[DONE]")
        self._end_events()


class OriginServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], config: OriginConfig) -> None:
        super().__init__(address, Handler)
        self.config = config

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-stream (an agent killed after its first token) is routine.
        pass

    def finish_request(self, request: Any, client_address: Any) -> None:
        # The TLS handshake runs in the connection's own thread, never in the accept loop.
        if isinstance(request, ssl.SSLSocket):
            try:
                request.settimeout(30)
                request.do_handshake()
            except (ssl.SSLError, OSError):
                return
        super().finish_request(request, client_address)


def serve(
    config: OriginConfig, cert: str, key: str, host: str = "127.0.0.1", port: int = 0
) -> OriginServer:
    """A TLS origin on `host:port` (0: any free port); the caller runs `serve_forever`."""
    server = OriginServer((host, port), config)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(
        server.socket, server_side=True, do_handshake_on_connect=False
    )
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description="Stand-in model API for `umbra up --check`.")
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--anthropic-key-sha256", required=True)
    parser.add_argument("--openai-key-sha256", required=True)
    parser.add_argument("--reply", default=REPLY)
    # Opt-in, tests only: also answer as the agents' own hosts (cli/vendor_origin.py).
    parser.add_argument("--vendor-listen", help="ADDR:PORT for api.anthropic.com, chatgpt.com, …")
    parser.add_argument("--claude-oauth-sha256", default="")
    args = parser.parse_args()
    config = OriginConfig(
        {Api.ANTHROPIC: args.anthropic_key_sha256, Api.OPENAI: args.openai_key_sha256},
        reply=args.reply,
    )
    if args.vendor_listen:
        from umbra.cli.vendor_origin import VendorState, serve_vendor

        host, _, port = args.vendor_listen.rpartition(":")
        vendor = serve_vendor(
            VendorState(args.claude_oauth_sha256), args.cert, args.key, host, int(port),
            reply=args.reply,
        )  # fmt: skip
        threading.Thread(target=vendor.serve_forever, daemon=True).start()
    serve(config, args.cert, args.key, port=args.port).serve_forever()


if __name__ == "__main__":
    main()
