"""MCP's legacy HTTP+SSE transport: the client GETs an event stream whose first `endpoint` event
names the URL it POSTs its messages to; the server answers them on the event stream, and the POST
itself only gets 202. So a refusal answered on the POST alone would never reach the agent.

The proxy reads the event stream beside it (`EventTap`): an `endpoint` event registers that URL
(per CVM) in `SseEndpoints`. A refused POST to a registered URL forwards, in place of the refused
body, a `ping` with an id of the proxy's own (nothing of the refused body goes on), and the tap
replaces the server's answer to that ping with the refusal: one JSON-RPC error event per request
id of the refused body. Events pass unchanged and unheld, except while a refusal waits for its
answer: then the tap holds an incomplete event until it ends (at most `MAX_EVENT_BYTES`; past
that it is sent on as it comes), so a server streaming forever stalls nothing. Every complete
event is also handed to an observer (the tool-list check, `addons/mcp.py`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

MAX_EVENT_BYTES = 1 << 20
MAX_ENDPOINTS = 10_000
MAX_PENDING = 256
_SEPARATOR = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINES = re.compile(rb"\r\n|\n|\r")

EndpointKey = tuple[str, str, int, str]  # cvm, host, port, path with query


@dataclass
class SseEvent:
    name: str
    data: bytes


def parse_event(raw: bytes) -> SseEvent:
    name = "message"
    data: list[bytes] = []
    for line in _LINES.split(raw):
        field_name, _, value = line.partition(b":")
        value = value.removeprefix(b" ")
        if field_name == b"event":
            name = value.decode("utf-8", "replace")
        elif field_name == b"data":
            data.append(value)
    return SseEvent(name, b"\n".join(data))


def message_event(document: object) -> bytes:
    return b"event: message\r\ndata: " + json.dumps(document).encode() + b"\r\n\r\n"


@dataclass
class SseStream:
    """One event stream: the refusals waiting for the server's answer to their stand-in ping."""

    pending: dict[str, list[dict[str, object]]] = field(default_factory=dict)


class SseEndpoints:
    """The POST URLs announced on event streams this proxy process relays, per CVM."""

    def __init__(self) -> None:
        self._streams: OrderedDict[EndpointKey, SseStream] = OrderedDict()

    def announce(self, key: EndpointKey, stream: SseStream) -> None:
        self._streams[key] = stream
        self._streams.move_to_end(key)
        while len(self._streams) > MAX_ENDPOINTS:
            self._streams.popitem(last=False)

    def forget(self, stream: SseStream) -> None:
        for key in [k for k, v in self._streams.items() if v is stream]:
            del self._streams[key]

    def stream_for(self, key: EndpointKey) -> SseStream | None:
        return self._streams.get(key)


def endpoint_key(cvm: str, base: str, data: bytes) -> EndpointKey | None:
    """The key of the POST URL an `endpoint` event names (relative to the stream's URL)."""
    try:
        url = urlsplit(urljoin(base, data.decode("utf-8")))
        port = url.port or (443 if url.scheme == "https" else 80)
    except (UnicodeDecodeError, ValueError):
        return None
    if not url.hostname:
        return None
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    return (cvm, url.hostname.lower(), port, path)


def stand_in(stream: SseStream, errors: list[dict[str, object]]) -> bytes | None:
    """The `ping` to forward in place of a refused body; None when too many wait already."""
    if len(stream.pending) >= MAX_PENDING:
        return None
    ident = "umbra-refusal-" + secrets.token_hex(8)
    stream.pending[ident] = errors
    return json.dumps({"jsonrpc": "2.0", "id": ident, "method": "ping"}).encode()


class EventTap:
    """Reads an event stream chunk by chunk (mitmproxy's `response.stream`), announcing endpoints,
    observing events and answering refusals; returns what to send the client."""

    def __init__(
        self,
        endpoints: SseEndpoints,
        cvm: str,
        base: str,
        observe: Callable[[SseEvent], None],
    ) -> None:
        self.endpoints = endpoints
        self.stream = SseStream()
        self.cvm = cvm
        self.base = base
        self.observe = observe
        self.buf = b""  # the current incomplete event
        self.sent = 0  # how much of it the client already has
        self.overflow = False  # the current event is past MAX_EVENT_BYTES: passed, not read

    def __call__(self, chunk: bytes) -> bytes:
        if not chunk:  # the stream's end
            self.endpoints.forget(self.stream)
            rest = self.buf[self.sent :]
            self.buf, self.sent = b"", 0
            return rest
        self.buf += chunk
        out: list[bytes] = []
        while (match := _SEPARATOR.search(self.buf)) is not None:
            raw, self.buf = self.buf[: match.end()], self.buf[match.end() :]
            sent, self.sent = self.sent, 0
            if self.overflow:
                self.overflow = False
                out.append(raw[sent:])
                continue
            out.append(self._event(raw[: match.start()], raw, sent))
        if len(self.buf) > MAX_EVENT_BYTES:
            self.overflow = True
        if self.overflow or not self.stream.pending:
            out.append(self.buf[self.sent :])
            self.sent = len(self.buf)
            if self.overflow:
                self.buf, self.sent = b"", 0  # the rest of this event passes unread
        return b"".join(out)

    def _event(self, body: bytes, raw: bytes, sent: int) -> bytes:
        event = parse_event(body)
        if event.name == "endpoint":
            key = endpoint_key(self.cvm, self.base, event.data)
            if key is not None:
                self.endpoints.announce(key, self.stream)
        elif self.stream.pending and sent == 0:
            errors = self._answer_to_stand_in(event.data)
            if errors is not None:
                return b"".join(message_event(error) for error in errors)
        self.observe(event)
        return raw[sent:]

    def _answer_to_stand_in(self, data: bytes) -> list[dict[str, object]] | None:
        try:
            document = json.loads(data)
        except (ValueError, RecursionError):
            return None
        ident = document.get("id") if isinstance(document, dict) else None
        if not isinstance(ident, str) or "method" in document:
            return None
        return self.stream.pending.pop(ident, None)
