"""Bounded decoding of request content into every form a secret could hide in.

`content_decode` undoes Content-Encoding chains (gzip, deflate, br, zstd) with a hard output
limit; `layers` yields a buffer and then, recursively up to a fixed depth and byte budget, its
URL-decoded, JSON-unescaped, base64-decoded, hex-decoded and decompressed forms, plus the parts of
a multipart body. Anything that cannot be decoded within the bounds raises `DecodeLimit` or
`DecodeError`, and the caller denies: content the proxy cannot read is content it does not forward.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import unquote_to_bytes

import brotli  # type: ignore[import-untyped]
import zstandard

MAX_DEPTH = 3
_CHUNK = 64 * 1024

_JSON_ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|([\"\\/bfnrt]))")
_SIMPLE_ESCAPES = {
    b'"': b'"',
    b"\\": b"\\",
    b"/": b"/",
    b"b": b"\b",
    b"f": b"\f",
    b"n": b"\n",
    b"r": b"\r",
    b"t": b"\t",
}
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_BOUNDARY = re.compile(r"boundary=(?:\"([^\"]{1,200})\"|([^;\s]{1,200}))", re.IGNORECASE)
_PART_CTE = re.compile(rb"content-transfer-encoding:\s*([a-z0-9-]+)", re.IGNORECASE)


class DecodeError(Exception):
    """Content that claims an encoding it does not have."""


class DecodeLimit(Exception):
    """Content whose decoding would exceed the proxy's bounds."""


def content_decode(data: bytes, encodings: str, limit: int) -> bytes:
    """Undo a Content-Encoding header value (applied in order, so undone in reverse)."""
    names = [name.strip().lower() for name in encodings.split(",") if name.strip()]
    if len(names) > 4:
        raise DecodeLimit("more than four stacked content encodings")
    for name in reversed(names):
        if name == "identity":
            continue
        data = decompress(data, name, limit)
    return data


def decompress(data: bytes | memoryview, name: str, limit: int) -> bytes:
    try:
        if name in ("gzip", "x-gzip"):
            return _zlib(data, zlib.MAX_WBITS | 32, limit)
        if name == "deflate":
            try:
                return _zlib(data, zlib.MAX_WBITS, limit)
            except zlib.error:
                return _zlib(data, -zlib.MAX_WBITS, limit)
        if name == "br":
            return _brotli(data, limit)
        if name == "zstd":
            return _zstd(data, limit)
    except (zlib.error, brotli.error, zstandard.ZstdError) as exc:
        raise DecodeError(f"{name} content does not decode ({type(exc).__name__})") from None
    raise DecodeError(f"unsupported content encoding {name[:40]!r}")


def _zlib(data: bytes | memoryview, wbits: int, limit: int) -> bytes:
    out = bytearray()
    decompressor = zlib.decompressobj(wbits)
    pending = data
    while True:
        out += decompressor.decompress(pending, _CHUNK)
        if len(out) > limit:
            raise DecodeLimit(f"decompressed content exceeds {limit} bytes")
        pending = decompressor.unconsumed_tail
        if decompressor.eof:
            if decompressor.unused_data.startswith(_GZIP_MAGIC):
                # concatenated gzip members
                return bytes(out) + _zlib(decompressor.unused_data, wbits, limit - len(out))
            return bytes(out)
        if not pending:
            out += decompressor.flush()
            if len(out) > limit:
                raise DecodeLimit(f"decompressed content exceeds {limit} bytes")
            finished: bool = getattr(decompressor, "eof")  # noqa: B009 (re-read after flush)
            if not finished:
                raise DecodeError("compressed content is truncated")
            return bytes(out)


def _brotli(data: bytes | memoryview, limit: int) -> bytes:
    out = bytearray()
    decompressor = brotli.Decompressor()
    chunk = decompressor.process(data, output_buffer_limit=_CHUNK)
    while True:
        out += chunk
        if len(out) > limit:
            raise DecodeLimit(f"decompressed content exceeds {limit} bytes")
        if decompressor.is_finished():
            return bytes(out)
        if decompressor.can_accept_more_data():
            raise DecodeError("br content is truncated")
        chunk = decompressor.process(b"", output_buffer_limit=_CHUNK)


def _zstd(data: bytes | memoryview, limit: int) -> bytes:
    out = bytearray()
    reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
    while True:
        chunk = reader.read(_CHUNK)
        if not chunk:
            return bytes(out)
        out += chunk
        if len(out) > limit:
            raise DecodeLimit(f"decompressed content exceeds {limit} bytes")


@dataclass
class Budget:
    """Total bytes the layers of one request may produce."""

    remaining: int
    exhausted: bool = field(default=False)

    def take(self, size: int) -> bool:
        if size > self.remaining:
            self.exhausted = True
            return False
        self.remaining -= size
        return True


def layers(data: bytes, budget: Budget, depth: int = 0) -> Iterator[bytes]:
    """`data` and, recursively, every decoding of it worth scanning."""
    yield data
    if depth >= MAX_DEPTH or not data:
        return
    for decoded in _decodings(data, budget):
        if not budget.take(len(decoded)):
            raise DecodeLimit("decoded content exceeds the scan budget")
        yield from layers(decoded, budget, depth + 1)


_B64_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-"
_HEX_CHARS = b"0123456789abcdefABCDEF"
# Line breaks continue a base64 run: MIME wraps base64 at 76 columns (what `base64` writes).
_B64_TABLE = bytes(0x41 if byte in _B64_CHARS + b"\r\n" else 0 for byte in range(256))
_B64_SEPARATORS = re.compile(rb"[/+]")
_HEX_TABLE = bytes(0x48 if byte in _HEX_CHARS else 0 for byte in range(256))
_PERCENT = re.compile(rb"%[0-9A-Fa-f]{2}")
_MIN_RUN = 16
_WINDOW = 768
_DENSE = 4096


def _runs(data: bytes, table: bytes, mark: int) -> Iterator[tuple[int, int]]:
    """(start, end) of every run of at least _MIN_RUN characters of one class, at C speed."""
    classes = data.translate(table)
    needle = bytes([mark]) * _MIN_RUN
    position = classes.find(needle)
    while position >= 0:
        end = classes.find(b"\0", position + _MIN_RUN)
        if end < 0:
            end = len(data)
        yield position, end
        position = classes.find(needle, end)


def _windows(data: bytes, pattern: re.Pattern[bytes]) -> Iterator[bytes]:
    """Regions around each match of `pattern`; the whole buffer when matches are dense."""
    spans: list[list[int]] = []
    for count, match in enumerate(pattern.finditer(data)):
        if count >= _DENSE:
            yield data
            return
        start, end = max(0, match.start() - _WINDOW), match.end() + _WINDOW
        if spans and start <= spans[-1][1]:
            spans[-1][1] = end
        else:
            spans.append([start, end])
    for start, end in spans:
        yield data[start:end]


def _decodings(data: bytes, budget: Budget) -> Iterator[bytes]:
    if b"%" in data:
        for window in _windows(data, _PERCENT):
            yield unquote_to_bytes(window.replace(b"+", b" "))
    if b"\\" in data:
        for window in _windows(data, _JSON_ESCAPE):
            yield _JSON_ESCAPE.sub(_unescape, window)
    for start, end in _runs(data, _B64_TABLE, 0x41):
        yield from _b64_all(data[start:end])
    for start, end in _runs(data, _HEX_TABLE, 0x48):
        # Both alignments: the run may start with a hex-looking character that is not part of it.
        for shift in (0, 1):
            length = (end - start - shift) // 2 * 2
            if length >= _MIN_RUN:
                yield binascii.unhexlify(data[start + shift : start + shift + length])
    for magic, name in ((_GZIP_MAGIC, "gzip"), (_ZSTD_MAGIC, "zstd")):
        start = data.find(magic)
        if start >= 0:
            # A stray magic number inside other data is not an error.
            with contextlib.suppress(DecodeError):
                yield decompress(memoryview(data)[start:], name, budget.remaining)


def _unescape(match: re.Match[bytes]) -> bytes:
    if match.group(1) is not None:
        return chr(int(match.group(1), 16)).encode("utf-8", "surrogatepass")
    return _SIMPLE_ESCAPES[match.group(2)]


def _b64_all(run: bytes) -> Iterator[bytes]:
    """Every plausible decoding of a base64-alphabet run: a token may start misaligned (right after
    other alphabet characters, e.g. `/p/<token>`), so each piece is decoded at all four offsets;
    a run mixing both alphabets is also split at `/` and `+` (a base64url token inside a path)."""
    run = run.translate(None, b"\r\n")
    pieces = [run]
    if (b"-" in run or b"_" in run) and (b"+" in run or b"/" in run):
        pieces += [piece for piece in _B64_SEPARATORS.split(run) if len(piece) >= _MIN_RUN]
    seen: set[bytes] = set()
    for piece in pieces:
        for shift in range(4):
            if len(piece) - shift < _MIN_RUN:
                break
            decoded = _b64(piece[shift:])
            if decoded and decoded not in seen:
                seen.add(decoded)
                yield decoded


def _b64(run: bytes) -> bytes | None:
    body = run.rstrip(b"=")
    alphabet_urlsafe = b"-" in body or b"_" in body
    if alphabet_urlsafe and (b"+" in body or b"/" in body):
        return None
    body = body[: len(body) - len(body) % 4] if len(body) % 4 == 1 else body
    padded = body + b"=" * (-len(body) % 4)
    try:
        if alphabet_urlsafe:
            return base64.urlsafe_b64decode(padded)
        return base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError):
        return None


def multipart_parts(body: bytes, content_type: str, limit: int) -> list[bytes]:
    """Each part of a multipart body, its transfer encoding (base64, quoted-printable) undone."""
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise DecodeError("multipart body without a boundary")
    boundary = b"--" + (match.group(1) or match.group(2)).encode("latin-1")
    parts: list[bytes] = []
    for chunk in body.split(boundary)[1:]:
        if chunk.startswith(b"--"):
            break
        head, sep, content = chunk.partition(b"\r\n\r\n")
        if not sep:
            head, sep, content = chunk.partition(b"\n\n")
        cte = _PART_CTE.search(head)
        encoding = cte.group(1).lower() if cte else b""
        if encoding == b"base64":
            try:
                content = base64.b64decode(b"".join(content.split()), validate=False)
            except (binascii.Error, ValueError):
                raise DecodeError("multipart part is not valid base64") from None
        elif encoding == b"quoted-printable":
            content = binascii.a2b_qp(content)
        parts.append(head)
        parts.append(content)
        if sum(len(part) for part in parts) > limit:
            raise DecodeLimit("multipart parts exceed the scan budget")
    return parts
