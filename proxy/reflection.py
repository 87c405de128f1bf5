"""Reflection guard: is an injected credential coming back in a response, checked while streaming.

For each injected value the guard matches every encoded form the scanner knows
(`scanner.secret_encodings`: raw, hex, URL, JSON, base64/base64url at every alignment) with one
Hyperscan *stream-mode* database, so a form split across chunks still matches. Content-Encoding
(gzip, deflate, br, zstd, stacked) is undone on the fly; only decoded bytes are matched.

Nothing is held back longer than the matcher needs: after each chunk, the guard keeps back only the
longest tail of the (decoded) data that is a proper prefix of some form, so a credential's first
half never reaches the client before its second half is seen. For a compressed body, a chunk is held
whole while its decoded tail is such a prefix. A hit raises `Reflected`: the caller cuts the stream.
"""

from __future__ import annotations

import re
import threading
import zlib
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Protocol

import brotli  # type: ignore[import-untyped]
import hyperscan
import zstandard

from umbra.proxy.reassembly import Reassembler, Reflected
from umbra.proxy.scanner import secret_encodings

__all__ = ["BodyStream", "Reflected", "ReflectionGuard", "UnsupportedEncoding"]

# A decoded response may be this many times its encoded size (plus slack) before it is called a bomb.
_MAX_RATIO = 1024
_SLACK = 1 << 20


class UnsupportedEncoding(Exception):
    pass


class _Decoder(Protocol):
    def feed(self, data: bytes) -> bytes: ...

    def flush(self) -> bytes:
        """What the decoder still buffers at the end of the body."""
        ...


class _Zlib:
    def __init__(self, wbits: int) -> None:
        self._obj = zlib.decompressobj(wbits)

    def feed(self, data: bytes) -> bytes:
        try:
            return self._obj.decompress(data)
        except zlib.error as exc:
            raise Reflected(f"undecodable response ({exc})") from None

    def flush(self) -> bytes:
        try:
            return self._obj.flush()
        except zlib.error as exc:
            raise Reflected(f"undecodable response ({exc})") from None


class _Brotli:
    def __init__(self) -> None:
        self._obj = brotli.Decompressor()

    def feed(self, data: bytes) -> bytes:
        try:
            return bytes(self._obj.process(data))
        except brotli.error as exc:
            raise Reflected(f"undecodable response ({exc})") from None

    def flush(self) -> bytes:
        return b""  # `process` returns all it can decode


class _Zstd:
    def __init__(self) -> None:
        self._obj = zstandard.ZstdDecompressor().decompressobj()

    def feed(self, data: bytes) -> bytes:
        try:
            return self._obj.decompress(data)
        except zstandard.ZstdError as exc:
            raise Reflected(f"undecodable response ({exc})") from None

    def flush(self) -> bytes:
        try:
            return bytes(self._obj.flush())
        except zstandard.ZstdError as exc:
            raise Reflected(f"undecodable response ({exc})") from None


_DECODERS: dict[str, Callable[[], _Decoder]] = {
    "gzip": lambda: _Zlib(16 + zlib.MAX_WBITS),
    "x-gzip": lambda: _Zlib(16 + zlib.MAX_WBITS),
    "deflate": lambda: _Zlib(zlib.MAX_WBITS),
    "br": _Brotli,
    "zstd": _Zstd,
}


def decoders_for(content_encoding: str) -> list[_Decoder]:
    """Decoders in the order to apply them (the header lists them in the order applied)."""
    names = [part.strip().lower() for part in content_encoding.split(",") if part.strip()]
    chain: list[_Decoder] = []
    for name in reversed(names):
        if name == "identity":
            continue
        factory = _DECODERS.get(name)
        if factory is None or len(chain) >= 4:
            raise UnsupportedEncoding(f"Content-Encoding {name[:32]!r} cannot be checked")
        chain.append(factory())
    return chain


class _Forms:
    """The compiled forms of one set of injected values (shared by every flow that injects it)."""

    def __init__(self, values: Sequence[str]) -> None:
        forms = sorted({form for value in values for form in secret_encodings(value.encode())})
        if not forms:
            raise ValueError("no form to match")
        self.forms = forms
        self.longest = max(len(form) for form in forms)
        self.prefixes = {form[:k] for form in forms for k in range(1, len(form))}
        self.db = hyperscan.Database(mode=hyperscan.HS_MODE_STREAM)
        self.db.compile(
            expressions=[b"".join(b"\\x%02x" % byte for byte in form) for form in forms],
            ids=list(range(len(forms))),
            flags=[hyperscan.HS_FLAG_SINGLEMATCH] * len(forms),
        )
        self._local = threading.local()

    def scratch(self) -> hyperscan.Scratch:
        # Scratch space is per thread (scans may run off the event loop).
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = hyperscan.Scratch(self.db)
        return scratch

    def partial_tail(self, data: bytes) -> int:
        """Length of the longest tail of `data` that is a proper prefix of some form."""
        for size in range(min(self.longest - 1, len(data)), 0, -1):
            if data[-size:] in self.prefixes:
                return size
        return 0


_cache: dict[tuple[str, ...], _Forms] = {}
_cache_lock = threading.Lock()


def _forms(values: Sequence[str]) -> _Forms:
    key = tuple(sorted(set(values)))
    with _cache_lock:
        found = _cache.get(key)
        if found is None:
            if len(_cache) > 256:
                _cache.clear()
            found = _cache[key] = _Forms(key)
        return found


class ReflectionGuard:
    def __init__(self, values: Sequence[str]) -> None:
        self._values = list(values)
        self._forms = _forms(values)

    def in_headers(self, head: bytes) -> bool:
        return any(form in head for form in self._forms.forms)

    def stream(self, content_encoding: str, content_type: str = "") -> BodyStream:
        """A body; a stream of events (server-sent events, declared or recognised by their first
        field, or declared JSON Lines) is also checked event by event for a credential in pieces
        (`reassembly`)."""
        media = content_type.split(";", 1)[0].strip().lower()
        framing = (
            Framing.SSE
            if media == "text/event-stream"
            else Framing.LINES
            if media in _LINE_TYPES
            else None
        )
        values = self._values
        return BodyStream(
            self._forms, decoders_for(content_encoding), lambda: Reassembler(values), framing
        )

    def messages(self) -> Reassembler:
        """A WebSocket connection's messages from the server, checked for a credential in pieces."""
        return Reassembler(self._values)


class Framing(StrEnum):
    """How a response body is a sequence of texts a client may join."""

    SSE = "sse"  # events end at a blank line; their `data:` lines are the text
    LINES = "lines"  # each line is one text (NDJSON, JSON Lines, JSON text sequences)


_LINE_TYPES = {
    "application/x-ndjson",
    "application/ndjson",
    "application/jsonl",
    "application/jsonlines",
    "application/x-jsonlines",
    "application/json-seq",
    "application/stream+json",
}
# Server-sent events whatever the content type says (a client reading the stream with its own
# parser does not check it): the body opens with an event field or a comment.
_BOM = b"\xef\xbb\xbf"
_SSE_OPENINGS = tuple(
    bom + field for bom in (b"", _BOM) for field in (b"data:", b"event:", b"id:", b"retry:", b": ")
)
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE_END = re.compile(rb"\r\n|\n|\r")
_MAX_EVENT = 1 << 20


def event_data(event: bytes) -> bytes:
    """The data of one server-sent event (its `data:` lines joined by line feeds)."""
    lines = [line.rstrip(b"\r") for line in event.split(b"\n")]
    data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
    return b"\n".join(data)


class BodyStream:
    """One response body: `feed` each chunk, then `finish`; both return bytes safe to pass on."""

    def __init__(
        self,
        forms: _Forms,
        decoders: list[_Decoder],
        reassembler: Callable[[], Reassembler] | None = None,
        framing: Framing | None = None,
    ) -> None:
        """`framing` None: the body's first bytes decide whether it is server-sent events."""
        self._forms = forms
        self._decoders = decoders
        self._reassembler = reassembler
        self._framing = framing
        self._sniffing = reassembler is not None and framing is None
        self._events = reassembler() if reassembler is not None and framing is not None else None
        self._event_buf = b""  # decoded bytes of the event not yet complete
        self._event_start = 0  # its offset in the decoded body
        # where the events held for a pending start begin (0 while the first bytes are sniffed)
        self._chain_start: int | None = 0 if self._sniffing else None
        self._passed = 0  # encoded bytes passed on
        self._hit = False
        self._closed = False
        self._held = b""  # encoded bytes not yet passed on
        self._tail = b""  # the last decoded bytes (for the partial-prefix check)
        self._encoded = 0
        self._decoded = 0

        # Keep the Stream object itself referenced (python-hyperscan frees the native stream with
        # it) and pass scratch and handler on every scan: the defaults crash on a second stream.
        self._owner = forms.db.stream(match_event_handler=self._on_match)
        self._stream = self._owner.__enter__()

    def _on_match(self, _id: int, _start: int, _end: int, _flags: int, _ctx: object) -> None:
        self._hit = True

    def _decode(self, chunk: bytes) -> bytes:
        data = chunk
        for decoder in self._decoders:
            data = decoder.feed(data)
        return data

    def feed(self, chunk: bytes) -> bytes:
        if self._closed:
            raise Reflected("stream already cut")
        self._encoded += len(chunk)
        decoded = self._checked(lambda: self._decode(chunk))
        if decoded:
            self._tail = (self._tail + decoded)[-self._forms.longest :]
        pending = self._held + chunk
        hold = self._forms.partial_tail(self._tail)
        if self._chain_start is not None:
            # events that start a credential wait for the next one (identity: offsets agree)
            hold = max(hold, self._passed + len(pending) - self._chain_start)
        if not hold:
            self._held = b""
            self._passed += len(pending)
            return pending
        if self._decoders:
            self._held = pending  # cannot split encoded bytes at a decoded offset: hold it all
            return b""
        hold = min(hold, len(pending))
        self._held = pending[len(pending) - hold :]
        self._passed += len(pending) - hold
        return pending[: len(pending) - hold]

    def finish(self) -> bytes:
        """End of body: whatever the decoders still buffer is checked, then the held bytes (a
        prefix that never completed) are passed on."""
        if self._closed:
            raise Reflected("stream already cut")
        self._checked(self._flush)
        if self._sniffing:
            self._checked(lambda: self._sniff(b"", final=True))
        if self._events is not None and self._event_buf:
            self._checked(self._last_event)
        held = self._held
        self._close()
        return held

    def _last_event(self) -> bytes:
        # An event without its blank line is not dispatched by clients; checked all the same.
        assert self._events is not None
        self._events.add(self._event_text(self._event_buf))
        self._event_buf = b""
        return b""

    def _event_text(self, event: bytes) -> bytes:
        return event_data(event) if self._framing is Framing.SSE else event

    def _sniff(self, decoded: bytes, final: bool = False) -> bytes:
        """Decide from the body's first bytes whether they open server-sent events (then they are
        split like declared ones) or not (then no more); bytes that could still open one wait
        (any other first byte decides at once, so nothing else is held)."""
        buf = self._event_buf + decoded
        if not final and any(
            len(buf) < len(opening) and opening.startswith(buf) for opening in _SSE_OPENINGS
        ):
            self._event_buf = buf  # could still open an event: held (at most 8 bytes)
            return b""
        self._sniffing = False
        self._event_buf = b""
        self._chain_start = None
        if self._reassembler is not None and buf.startswith(_SSE_OPENINGS):
            self._framing = Framing.SSE
            self._events = self._reassembler()
            self._split_events(buf)
        return b""

    def _split_events(self, decoded: bytes) -> None:
        """Feed each complete event to the reassembler; remember where a pending chain starts."""
        assert self._events is not None
        buf = self._event_buf + decoded
        ends = _EVENT_END if self._framing is Framing.SSE else _LINE_END
        if self._event_start == 0 and buf.startswith(_BOM):
            buf = buf[len(_BOM) :]  # clients drop it: the first field follows
            self._event_start = len(_BOM)
        while True:
            match = ends.search(buf)
            if match is None:
                if len(buf) <= _MAX_EVENT:
                    break
                end = stop = len(buf)  # an endless event: checked in bounded pieces
            else:
                end, stop = match.start(), match.end()
            start = self._event_start
            if self._events.add(self._event_text(buf[:end])):
                if self._chain_start is None:
                    self._chain_start = start
            else:
                self._chain_start = None
            buf = buf[stop:]
            self._event_start += stop
        self._event_buf = buf

    def _flush(self) -> bytes:
        rest = b""
        for decoder in self._decoders:
            rest = (decoder.feed(rest) if rest else b"") + decoder.flush()
        return rest

    def _checked(self, decode: Callable[[], bytes]) -> bytes:
        """Decode, then match the decoded bytes against every form; an undecodable body, a bomb or
        a hit closes the stream and raises `Reflected` (the caller cuts it)."""
        try:
            decoded = decode()
            self._decoded += len(decoded)
            if self._decoded > _MAX_RATIO * self._encoded + _SLACK:
                raise Reflected("response decodes beyond its bound")
            if decoded:
                self._stream.scan(
                    decoded, scratch=self._forms.scratch(), match_event_handler=self._on_match
                )
            if self._hit:
                raise Reflected("response reflects an injected credential")
            if decoded and self._sniffing:
                self._sniff(decoded)
            elif decoded and self._events is not None:
                self._split_events(decoded)
            if self._hit:
                raise Reflected("response reflects an injected credential")
        except Reflected:
            self._close()
            raise
        return decoded

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._held = b""
            self._owner.__exit__(None, None, None)
