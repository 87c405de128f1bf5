"""Content-Encoding decompression with a hard output limit: `content_decode` undoes a header's
chain (gzip, deflate, br, zstd, and the aws-chunked framing), `decompress` one encoding, and
`decompress_at` a stream found inside a buffer (the scanner's decoding levels, proxy/decode.py).
Content that is not what it claims raises `DecodeError`; output over the limit, `DecodeLimit`."""

from __future__ import annotations

import zlib

import brotli  # type: ignore[import-untyped]
import zstandard

from umbra.proxy.aws_chunked import AwsChunkedError, unchunk

_CHUNK = 64 * 1024
_GZIP_MAGIC = b"\x1f\x8b"


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
        if name == "aws-chunked":  # a framing, not a compression (proxy/aws_chunked.py)
            try:
                data = unchunk(data)
            except AwsChunkedError as exc:
                raise DecodeError(str(exc)) from None
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
    return _zlib_span(data, wbits, limit)[0]


def _zlib_span(data: bytes | memoryview, wbits: int, limit: int) -> tuple[bytes, int]:
    """The decompressed content and how many input bytes it took (concatenated gzip members are
    one content)."""
    out = bytearray()
    decompressor = zlib.decompressobj(wbits)
    pending = data
    while True:
        out += decompressor.decompress(pending, _CHUNK)
        if len(out) > limit:
            raise DecodeLimit(f"decompressed content exceeds {limit} bytes")
        pending = decompressor.unconsumed_tail
        if decompressor.eof:
            rest = decompressor.unused_data
            if rest.startswith(_GZIP_MAGIC):
                # concatenated gzip members
                more, used = _zlib_span(rest, wbits, limit - len(out))
                return bytes(out) + more, len(data) - len(rest) + used
            return bytes(out), len(data) - len(rest)
        if not pending:
            out += decompressor.flush()
            if len(out) > limit:
                raise DecodeLimit(f"decompressed content exceeds {limit} bytes")
            finished: bool = getattr(decompressor, "eof")  # noqa: B009 (re-read after flush)
            if not finished:
                raise DecodeError("compressed content is truncated")
            return bytes(out), len(data)


def decompress_at(data: bytes, start: int, name: str, limit: int) -> tuple[bytes, int]:
    """Decompress the stream starting at `start` (a magic number): its content and input length
    (for zstd, which reads across frames to the end, the rest of `data`)."""
    view = memoryview(data)[start:]
    if name == "zstd":
        return decompress(view, name, limit), len(view)
    try:
        return _zlib_span(view, zlib.MAX_WBITS | 32, limit)
    except zlib.error as exc:
        raise DecodeError(f"{name} content does not decode ({type(exc).__name__})") from None


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
