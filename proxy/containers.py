"""What a client can send without saying so: containers and encodings recognised by their bytes.

`expand(data, ...)` returns the texts hidden in one request body, each to be scanned like the body:
compressed streams sniffed by their magic (gzip, zlib, bzip2, xz, zstd) or tried on binary bodies
(raw deflate, brotli), archives (zip, tar, and their compressed forms by recursion), every object of
a git packfile inflated (deltas' instruction streams included, which carry their literal data),
gRPC messages (every `grpc-encoding` the proxy can undo; any other is refused) and UTF-16/UTF-32
text (by BOM or by its NUL pattern), whatever the content type says (HTML/XML numeric character
references are a decoding trigger of the scanner's levels, `decode.Trigger.CHARREF`). Everything runs under one `Limits` (bytes produced, ratio to the input, nesting depth, time),
which fails closed: `DecodeLimit` (413 `scan_limit`). A container that claims its format and breaks
it raises `Malformed` with its own reason (truncated packfile, lying length, bad archive, gRPC
frame with a wrong length): the request is refused, never forwarded unscanned.
"""

from __future__ import annotations

import bz2
import contextlib
import io
import lzma
import re
import tarfile
import time
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import brotli  # type: ignore[import-untyped]
import zstandard

from umbra.proxy.decode import Budget, DecodeLimit

_CHUNK = 64 * 1024


class Malformed(Exception):
    """A container whose bytes claim a format they then break."""

    def __init__(self, reason: MalformedReason, detail: str) -> None:
        self.reason = reason
        super().__init__(detail)


class MalformedReason(StrEnum):
    PACKFILE = "malformed_packfile"
    ARCHIVE = "malformed_archive"
    GRPC = "malformed_grpc"
    COMPRESSED = "undecodable_content"


@dataclass
class Limits:
    """The request's one scan budget (bytes, shared with the scanner's decoding levels), plus the
    ratio of output to input, the nesting depth and a deadline."""

    budget: Budget
    ratio: int = 1024
    depth: int = 4
    deadline: float = field(default_factory=lambda: time.monotonic() + 5.0)
    produced: int = 0
    consumed: int = 0

    def take(self, size: int) -> None:
        self.produced += size
        if not self.budget.take(size):
            raise DecodeLimit("decoded content exceeds the scan budget")
        if self.produced > self.ratio * max(self.consumed, 1) + (1 << 20):
            raise DecodeLimit("content decodes beyond its ratio bound (a bomb)")
        self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise DecodeLimit("decoding took longer than the scan allows")


def _inflate(
    view: memoryview, wbits: int, limits: Limits, partial: bool = False
) -> tuple[bytes, int]:
    """Inflate one zlib/deflate stream at the start of `view`: content and bytes consumed. With
    `partial` (a stream only guessed at), a broken stream yields what it decoded so far: an origin
    may use that much, so it is scanned; it is not an error."""
    decompressor = zlib.decompressobj(wbits)
    out = bytearray()
    position = 0
    while not decompressor.eof:
        if position >= len(view) and not decompressor.unconsumed_tail:
            if partial:
                return bytes(out), position
            raise zlib.error("stream is truncated")
        piece = decompressor.unconsumed_tail or view[position : position + _CHUNK]
        if not decompressor.unconsumed_tail:
            position += len(piece)
        try:
            produced = decompressor.decompress(piece, _CHUNK)
        except zlib.error:
            if partial:
                return bytes(out), position
            raise
        limits.take(len(produced))
        out += produced
    consumed = position - len(decompressor.unused_data)
    return bytes(out), consumed


_OBJ_COMMIT, _OBJ_TAG, _OFS_DELTA, _REF_DELTA = 1, 4, 6, 7


def packfile(data: bytes, start: int, limits: Limits) -> list[bytes]:
    """Every object of the packfile at `start`, inflated (a delta's instructions as they are)."""
    view = memoryview(data)
    if len(data) < start + 12:
        raise Malformed(MalformedReason.PACKFILE, "packfile header is truncated")
    count = int.from_bytes(data[start + 8 : start + 12], "big")
    if count > 10_000_000:
        raise Malformed(MalformedReason.PACKFILE, "packfile claims too many objects")
    position = start + 12
    objects: list[bytes] = []
    try:
        for _ in range(count):
            byte = data[position]
            position += 1
            kind = (byte >> 4) & 7
            size, shift = byte & 15, 4
            while byte & 0x80:
                byte = data[position]
                position += 1
                size |= (byte & 0x7F) << shift
                shift += 7
                if shift > 70:
                    raise Malformed(MalformedReason.PACKFILE, "object size does not end")
            if kind == _OFS_DELTA:
                byte = data[position]
                position += 1
                while byte & 0x80:
                    byte = data[position]
                    position += 1
            elif kind == _REF_DELTA:
                position += 20
            elif not _OBJ_COMMIT <= kind <= _OBJ_TAG:
                raise Malformed(MalformedReason.PACKFILE, f"unknown object type {kind}")
            content, used = _inflate(view[position:], zlib.MAX_WBITS, limits)
            if len(content) != size:
                raise Malformed(MalformedReason.PACKFILE, "object length does not match its header")
            objects.append(content)
            position += used
    except IndexError:
        raise Malformed(MalformedReason.PACKFILE, "packfile is truncated") from None
    except zlib.error:
        raise Malformed(MalformedReason.PACKFILE, "packfile object does not inflate") from None
    return objects


def _read_bounded(read: Callable[[int], bytes], limits: Limits) -> bytes:
    out = bytearray()
    while chunk := read(_CHUNK):
        limits.take(len(chunk))
        out += chunk
    return bytes(out)


def _zip(data: bytes, limits: Limits) -> list[bytes]:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = []
            for info in archive.infolist():
                if info.is_dir():
                    continue
                if info.flag_bits & 0x1:
                    raise Malformed(MalformedReason.ARCHIVE, "encrypted zip member")
                members.append(info.filename.encode("utf-8", "replace"))
                with archive.open(info) as member:
                    members.append(_read_bounded(member.read, limits))
            return members
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError, OSError):
        raise Malformed(MalformedReason.ARCHIVE, "zip archive does not read") from None
    except (zlib.error, lzma.LZMAError, ValueError):
        raise Malformed(MalformedReason.ARCHIVE, "zip member does not decompress") from None


def _tar(data: bytes, limits: Limits) -> list[bytes]:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
            members = []
            for info in archive:
                members.append(info.name.encode("utf-8", "replace"))
                if info.isfile():
                    handle = archive.extractfile(info)
                    if handle is not None:
                        members.append(_read_bounded(handle.read, limits))
            return members
    except (tarfile.TarError, EOFError, OSError):
        raise Malformed(MalformedReason.ARCHIVE, "tar archive does not read") from None


def _stream(factory: Callable[[], object], data: bytes, limits: Limits) -> bytes:
    """A whole compressed body (bz2, xz) with bounded output."""
    decompressor = factory()
    out = bytearray()
    pending = data
    while True:
        produced = decompressor.decompress(pending, _CHUNK)  # type: ignore[attr-defined]
        limits.take(len(produced))
        out += produced
        if decompressor.eof:  # type: ignore[attr-defined]
            return bytes(out)
        if decompressor.needs_input:  # type: ignore[attr-defined]
            raise EOFError("compressed stream is truncated")
        pending = b""


def _zstd(data: bytes, limits: Limits) -> bytes:
    reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
    return _read_bounded(reader.read, limits)


def _brotli(data: bytes, limits: Limits) -> bytes:
    decompressor = brotli.Decompressor()
    out = bytearray()
    chunk = decompressor.process(data, output_buffer_limit=_CHUNK)
    while True:
        limits.take(len(chunk))
        out += chunk
        if decompressor.is_finished():
            return bytes(out)
        if decompressor.can_accept_more_data():
            raise brotli.error("truncated")
        chunk = decompressor.process(b"", output_buffer_limit=_CHUNK)


_PACK = re.compile(rb"PACK\x00\x00\x00[\x02\x03]")
_TEXT = bytes([9, 10, 13, *range(0x20, 0x7F)])


def _wide_text(data: bytes) -> bytes | None:
    """UTF-32 or UTF-16 text (by BOM, or by NULs where ASCII text in that encoding has them)."""
    for bom, codec in (
        (b"\xff\xfe\x00\x00", "utf-32-le"),
        (b"\x00\x00\xfe\xff", "utf-32-be"),
        (b"\xff\xfe", "utf-16-le"),
        (b"\xfe\xff", "utf-16-be"),
    ):
        if data.startswith(bom):
            return data[len(bom) :].decode(codec, "replace").encode()
    sample = data[:4096]
    if len(sample) < 8 or sample.count(0) < len(sample) // 3:
        return None
    quads = [sample[i::4].count(0) for i in range(4)]
    pairs = [sample[i::2].count(0) for i in range(2)]
    quarter, half = len(sample) // 4, len(sample) // 2
    if min(quads[1:]) > 0.8 * quarter and quads[0] < 0.2 * quarter:
        return data[: len(data) // 4 * 4].decode("utf-32-le", "replace").encode()
    if min(quads[:3]) > 0.8 * quarter and quads[3] < 0.2 * quarter:
        return data[: len(data) // 4 * 4].decode("utf-32-be", "replace").encode()
    if pairs[1] > 0.8 * half and pairs[0] < 0.2 * half:
        return data[: len(data) // 2 * 2].decode("utf-16-le", "replace").encode()
    if pairs[0] > 0.8 * half and pairs[1] < 0.2 * half:
        return data[: len(data) // 2 * 2].decode("utf-16-be", "replace").encode()
    return None


def _binary(data: bytes) -> bool:
    head = data[:512]
    return bool(head) and len(head.translate(None, _TEXT)) > len(head) // 8


def _is_zlib(data: bytes) -> bool:
    # deflate, a window the format allows, no preset dictionary, the header checksum
    return (
        len(data) > 2
        and data[0] & 0x0F == 8
        and data[0] >> 4 <= 7
        and not data[1] & 0x20
        and (data[0] << 8 | data[1]) % 31 == 0
    )


_BZIP2 = re.compile(rb"BZh[1-9](?:1AY&SY|\x17rE8P\x90)")


GRPC_DECODERS: dict[str, Callable[[bytes, Limits], bytes]] = {
    "gzip": lambda data, limits: _inflate(memoryview(data), zlib.MAX_WBITS | 16, limits)[0],
    "deflate": lambda data, limits: _inflate(memoryview(data), zlib.MAX_WBITS, limits)[0],
    "zstd": _zstd,
}


def grpc_messages(data: bytes, encoding: str, limits: Limits) -> list[bytes]:
    """Each message of a gRPC body (length-prefixed frames), decompressed when flagged."""
    messages: list[bytes] = []
    position = 0
    name = encoding.strip().lower() or "identity"
    while position < len(data):
        if position + 5 > len(data):
            raise Malformed(MalformedReason.GRPC, "gRPC frame header is truncated")
        flag = data[position]
        length = int.from_bytes(data[position + 1 : position + 5], "big")
        if flag > 1:
            raise Malformed(MalformedReason.GRPC, "gRPC frame flag is not 0 or 1")
        if position + 5 + length > len(data):
            raise Malformed(MalformedReason.GRPC, "gRPC frame length exceeds the body")
        message = data[position + 5 : position + 5 + length]
        position += 5 + length
        if flag:
            decode = GRPC_DECODERS.get(name)
            if decode is None:
                raise Malformed(MalformedReason.GRPC, f"grpc-encoding {name[:32]!r} cannot be read")
            try:
                message = decode(message, limits)
            except (zlib.error, zstandard.ZstdError):
                raise Malformed(MalformedReason.GRPC, "gRPC message does not decompress") from None
        messages.append(message)
    return messages


def expand(data: bytes, limits: Limits, depth: int = 0) -> list[bytes]:
    """Every text hidden in `data` (not `data` itself), recursively, within `limits`."""
    if not data:
        return []
    limits.consumed += len(data)
    found: list[bytes] = []
    head = data[:8]
    try:
        if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
            found += _zip(data, limits)
        elif len(data) > 262 and data[257:262] == b"ustar":
            found += _tar(data, limits)
        elif head.startswith(b"\x1f\x8b\x08"):
            found.append(_inflate(memoryview(data), zlib.MAX_WBITS | 16, limits)[0])
        elif _BZIP2.match(data, 0, 10):
            found.append(_stream(bz2.BZ2Decompressor, data, limits))
        elif head.startswith(b"\xfd7zXZ\x00"):
            found.append(_stream(lzma.LZMADecompressor, data, limits))
        elif head.startswith(b"\x28\xb5\x2f\xfd"):
            found.append(_zstd(data, limits))
        elif _is_zlib(data):
            # a two-byte header is a weak sign: what inflates is scanned, a failure is no error
            found.append(_inflate(memoryview(data), zlib.MAX_WBITS, limits, partial=True)[0])
        elif _binary(data):
            # No magic: raw deflate and brotli are tried; binary that is neither is not an error.
            inflated = _inflate(memoryview(data), -zlib.MAX_WBITS, limits, partial=True)[0]
            if inflated:
                found.append(inflated)
            with contextlib.suppress(brotli.error):
                found.append(_brotli(data, limits))
    except (zlib.error, EOFError, OSError, lzma.LZMAError, zstandard.ZstdError) as exc:
        raise Malformed(
            MalformedReason.COMPRESSED, f"compressed content does not decode ({type(exc).__name__})"
        ) from None
    match = _PACK.search(data, 0, 1 << 16)
    if match is not None:
        found += packfile(data, match.start(), limits)
    wide = _wide_text(data)
    if wide is not None:
        limits.take(len(wide))
        found.append(wide)
    if found and depth >= limits.depth:
        raise DecodeLimit(f"containers nested deeper than {limits.depth} levels")
    nested: list[bytes] = []
    for piece in found:
        nested += expand(piece, limits, depth + 1)
    return found + nested
