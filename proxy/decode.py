"""Bounded decoding of request content into every form a secret could hide in.

`content_decode` (proxy/compression.py) undoes Content-Encoding chains (gzip, deflate, br, zstd) with a hard output
limit; `decode_level` turns one buffer into the next level of decodings (URL-decoded,
JSON-unescaped, base64-decoded at every alignment, hex-decoded, decompressed), from the trigger
offsets the scanner's Hyperscan pass found in it, within a byte budget; the scanner repeats that
until nothing is left to decode, and refuses content still encoded after `MAX_DEPTH` levels. `multipart_parts` splits a multipart body. Anything that cannot be decoded within the bounds raises `DecodeLimit` or
`DecodeError`, and the caller denies: content the proxy cannot read is content it does not forward."""

from __future__ import annotations

import base64
import binascii
import contextlib
import re
from dataclasses import dataclass, field
from enum import IntEnum

# Content-Encoding decompression is its own module; its names stay importable from here.
from umbra.proxy.compression import (
    DecodeError,
    DecodeLimit,
    content_decode,
    decompress,
    decompress_at,
)

__all__ = ["DecodeError", "DecodeLimit", "content_decode", "decompress"]

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
_BOUNDARY = re.compile(r"boundary=(?:\"([^\"]{1,200})\"|([^;\s]{1,200}))", re.IGNORECASE)
_PART_CTE = re.compile(rb"content-transfer-encoding:\s*([a-z0-9-]+)", re.IGNORECASE)


@dataclass
class Budget:
    """Total bytes the layers of one request may produce."""

    remaining: int
    exhausted: bool = field(default=False)
    # Base64 runs already decoded (their hashes: SipHash with a per-process key, so no input can
    # be made to collide): a decoded copy of a text carries its runs to the next level again, and
    # each would be decoded (at four offsets) once per level.
    seen_runs: set[int] = field(default_factory=set)

    def take(self, size: int) -> bool:
        if size > self.remaining:
            self.exhausted = True
            return False
        self.remaining -= size
        return True


# Decoding levels per buffer (base64 nested 8 times and mixed with hex, URL-encoding and JSON
# escapes is ~12). Content still holding something to decode at the last level is refused (413
# `scan_limit`), never forwarded with its lowest layer unscanned. Each level is smaller than the one
# it came from (every decoding shrinks its input; the misaligned base64 decodings are binary noise
# without runs), so ordinary bodies settle after 2-8 levels whatever this bound is.
MAX_DEPTH = 16

# What a layer can be decoded from, located by Hyperscan rather than by Python passes over the
# bytes. The trigger expressions are compiled into the scanner's database next to the rules, so
# they cost no extra pass; each reports the end offset of its match.
_B64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-"
_HEX_CHARS = b"0123456789abcdefABCDEF"
_MIN_RUN = 16
_WINDOW = 768
DENSE = 4096
_MAX_MAGIC_TRIES = 32


class Trigger(IntEnum):
    # the windowed kinds first: the scanner's dense check relies on their ids being the lowest
    PERCENT = 0
    ESCAPE = 1
    CHARREF = 2
    GZIP = 3
    ZSTD = 4


TRIGGERS: dict[Trigger, bytes] = {
    Trigger.PERCENT: rb"%[0-9A-Fa-f]{2}",
    Trigger.ESCAPE: rb"\\(?:u[0-9a-fA-F]{4}|[\"\\/bfnrt])",
    # HTML/XML numeric character references, whatever the content type says
    Trigger.CHARREF: rb"&#(?:[0-9]{1,7}|[xX][0-9a-fA-F]{1,6})",
    Trigger.GZIP: rb"\x1f\x8b\x08",
    Trigger.ZSTD: rb"\x28\xb5\x2f\xfd",
}
# Percent and JSON escapes and character references can be dense (a form post, an LLM prompt full
# of `\n`, an HTML page): past DENSE of one kind the scanner stops collecting offsets and the whole
# buffer is decoded for every windowed kind present.
WINDOWED = (Trigger.PERCENT, Trigger.ESCAPE, Trigger.CHARREF)
# A run of base64 characters (line breaks continue a run: MIME wraps base64 at 76 columns, as
# `base64` writes). Hex runs lie inside these (hex digits are base64 characters). The scanner runs
# this alone and stops at its first match, finds the run's end, and resumes after it: one report
# per run instead of one per byte (a "run starts here" expression would make Hyperscan ~50x slower).
RUN_EXPRESSION = rb"[A-Za-z0-9+/_\-\r\n]{16}"
RUN_LENGTH = _MIN_RUN


@dataclass
class Found:
    """What one buffer holds to decode: trigger offsets (match ends, increasing) and base64 runs
    (start, end); `dense` when a windowed kind was too frequent to window (its offsets are then
    incomplete and unused)."""

    offsets: list[list[int]] = field(default_factory=lambda: [[] for _ in Trigger])
    runs: list[tuple[int, int]] = field(default_factory=list)
    present: set[Trigger] = field(default_factory=set)
    dense: bool = False


def _class_table(chars: bytes) -> bytes:
    """A `bytes.translate` table: the class's bytes become 0x41, every other byte NUL."""
    return bytes(0x41 if byte in chars else 0 for byte in range(256))


_RUN_TABLE = _class_table(_B64_ALPHABET + b"\r\n")
_RUN_NEEDLE = b"\x41" * _MIN_RUN


def run_end(data: bytes, position: int) -> int:
    """Where the base64 run covering `position` ends (C-speed translates of growing slices)."""
    step = 256
    size = len(data)
    while position < size:
        segment = data[position : position + step]
        stop = segment.translate(_RUN_TABLE).find(0)
        if stop >= 0:
            return position + stop
        position += len(segment)
        step = min(step * 8, 1 << 20)
    return size


def dense_runs(data: bytes, position: int) -> list[tuple[int, int]]:
    """Every base64 run from `position` on, by one translate of the rest and a `find` per run:
    cheaper per run than restarting a Hyperscan scan when runs are many (source code, base64)."""
    classes = data[position:].translate(_RUN_TABLE)
    runs: list[tuple[int, int]] = []
    start = classes.find(_RUN_NEEDLE)
    while start >= 0:
        end = classes.find(0, start + _MIN_RUN)
        if end < 0:
            end = len(classes)
        runs.append((position + start, position + end))
        start = classes.find(_RUN_NEEDLE, end)
    return runs


# Levels below this decode each windowed kind into its own piece (every order of percent, JSON and
# character-reference decoding is tried); deeper levels compose them into one piece. Separate pieces
# each carry the other kinds' triggers, so a level of them is up to three times the size of the one
# before: that growth stops here, and the deep levels stay linear.
SEPARATE_LEVELS = 1


def decode_level(data: bytes, found: Found, budget: Budget, depth: int = 0) -> bytes:
    """Every decoding of `data` worth scanning, as one buffer: decoded pieces joined by NUL bytes
    (which no rule's token contains), so the next level is again one Hyperscan pass."""
    pieces: list[bytes] = []

    def add(piece: bytes) -> None:
        if not piece:
            return
        if not budget.take(len(piece) + 1):
            raise DecodeLimit("decoded content exceeds the scan budget")
        pieces.append(piece)

    offsets = found.offsets
    if depth >= SEPARATE_LEVELS:
        add(_composed(data, found))
    elif found.dense:
        if Trigger.PERCENT in found.present:
            add(_unquote(data))
        if Trigger.ESCAPE in found.present:
            add(_json_unescape(data))
        if Trigger.CHARREF in found.present:
            add(char_refs(data))
    else:
        if offsets[Trigger.PERCENT]:
            windows = _windows(data, offsets[Trigger.PERCENT], 3)
            add(_unquote(windows))
        if offsets[Trigger.ESCAPE]:
            add(_json_unescape(_windows(data, offsets[Trigger.ESCAPE], 6)))
        if offsets[Trigger.CHARREF]:
            add(char_refs(_windows(data, offsets[Trigger.CHARREF], 10)))
    runs = _fresh(data, found.runs, budget.seen_runs)
    if runs:
        add(_b64_runs(data, runs))
        add(_hex_runs(data, runs))
    for kind, name in ((Trigger.GZIP, "gzip"), (Trigger.ZSTD, "zstd")):
        consumed = -1
        for end in offsets[kind][:_MAX_MAGIC_TRIES]:
            start = end - (3 if kind is Trigger.GZIP else 4)
            if start < consumed:
                continue  # inside a stream already decoded (concatenated members)
            # A stray magic number inside other data is not an error.
            with contextlib.suppress(DecodeError):
                out, used = decompress_at(data, start, name, budget.remaining)
                consumed = start + used
                add(out)
    return b"\0".join(pieces)


def _fresh(data: bytes, runs: list[tuple[int, int]], seen: set[int]) -> list[tuple[int, int]]:
    fresh: list[tuple[int, int]] = []
    for start, end in runs:
        key = hash(data[start:end])
        if key not in seen:
            seen.add(key)
            fresh.append((start, end))
    return fresh


def _composed(data: bytes, found: Found) -> bytes:
    """The windowed kinds undone one after another in one piece: percent (without `+` as a space,
    which would split a base64 run inside it), then JSON escapes, then character references; what
    one order leaves encoded is still a trigger on the next level."""
    kinds = found.present.intersection(WINDOWED)
    if not kinds:
        return b""
    if not found.dense:
        ends = sorted(end for kind in kinds for end in found.offsets[kind])
        data = _windows(data, ends, 3)  # 3: inside every kind's match; the window grows over text
    if Trigger.PERCENT in kinds:
        data = _PERCENT.sub(lambda match: _HEX_BYTE[match[1]], data)
    if Trigger.ESCAPE in kinds:
        data = _json_unescape(data)
    if Trigger.CHARREF in kinds:
        data = char_refs(data)
    return data


# Bytes an encoded (percent, JSON-escaped) token and its neighbours can consist of: printable ASCII,
# whitespace and UTF-8. A window around an escape stops at any other byte (in binary data the
# windows stay a few bytes wide instead of 1.5 KiB each).
_TEXT_TABLE = _class_table(bytes([9, 10, 13, *range(0x20, 0x7F), *range(0x80, 0x100)]))


def _windows(data: bytes, ends: list[int], width: int) -> bytes:
    """The text around each match (ending at `ends`, at most _WINDOW bytes either side), merged,
    joined by NUL bytes."""
    spans: list[list[int]] = []
    size = len(data)
    for end in ends:
        start = end - width
        if spans and start - _WINDOW <= spans[-1][1]:
            left = spans[-1][1]  # near the previous window: merged with it
        else:
            left = _text_start(data, start)
        stop = _text_end(data, end)
        if spans and left <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], stop)
        else:
            spans.append([left, stop])
    if len(spans) == 1 and spans[0][0] == 0 and spans[0][1] >= size:
        return data
    view = memoryview(data)
    return b"\0".join([view[start:stop] for start, stop in spans])


_PROBE = 32


def _text_start(data: bytes, start: int) -> int:
    # A short probe first: in binary data a non-text byte is a few bytes away.
    for reach in (_PROBE, _WINDOW):
        low = start - reach if start > reach else 0
        found = data[low:start].translate(_TEXT_TABLE).rfind(0)
        if found >= 0:
            return low + found + 1
        if low == 0:
            return 0
    return start - _WINDOW


def _text_end(data: bytes, end: int) -> int:
    for reach in (_PROBE, _WINDOW):
        found = data[end : end + reach].translate(_TEXT_TABLE).find(0)
        if found >= 0:
            return end + found
    return min(end + _WINDOW, len(data))


_CHAR_REF = re.compile(rb"&#(?:([0-9]{1,7})|[xX]([0-9a-fA-F]{1,6}));?")


def _char_ref(match: re.Match[bytes]) -> bytes:
    number = int(match[1]) if match[1] is not None else int(match[2], 16)
    return chr(number).encode("utf-8", "surrogatepass") if number < 0x110000 else b""


def char_refs(data: bytes) -> bytes:
    """HTML/XML numeric character references (`&#103;`, `&#x67;`) undone."""
    return _CHAR_REF.sub(_char_ref, data)


_PERCENT = re.compile(rb"%([0-9A-Fa-f]{2})")
_HEX_BYTE = {
    f"{high}{low}".encode(): bytes([int(f"{high}{low}", 16)])
    for high in "0123456789abcdefABCDEF"
    for low in "0123456789abcdefABCDEF"
}


def _unquote(data: bytes) -> bytes:
    """URL-decode (`+` is a space), with Python work per escape only, not per `%`."""
    return _PERCENT.sub(lambda match: _HEX_BYTE[match[1]], data.replace(b"+", b" "))


_B64_RUN_CHARS = _B64_ALPHABET + b"\r\n"
_URL_TO_STD = bytes.maketrans(b"-_", b"+/")
_B64_SEPARATORS = re.compile(rb"[/+]")
_B64_VALUE = {char: index for index, char in enumerate(_B64_ALPHABET[:64])}
# Two characters completing a 2-character tail: its decoded byte is followed by a byte that is not
# a word character (chosen from the tail's last value) and a NUL, so no token grows past the run.
_PAD2 = {
    char: (b"oA" if value & 15 == 3 else b"sA" if value & 15 in (5, 7) else b"AA")
    for char, value in _B64_VALUE.items()
}
_B64_GAP = b"AAAA"  # decodes to three NUL bytes between runs


def _b64_runs(data: bytes, runs: list[tuple[int, int]]) -> bytes:
    """Every plausible decoding of each base64 run, in one C call: a token may start misaligned
    (right after other alphabet characters, e.g. `/p/<token>`), so each run is decoded at all four
    offsets; a run mixing both alphabets is split at `/` and `+` (a base64url token in a path)."""
    encoded: list[bytes] = []
    for start, end in runs:
        run = data[start:end].translate(None, b"\r\n")
        if (b"-" in run or b"_" in run) and (b"+" in run or b"/" in run):
            pieces = [piece for piece in _B64_SEPARATORS.split(run) if len(piece) >= _MIN_RUN]
        else:
            pieces = [run]
        for piece in pieces:
            piece = piece.translate(_URL_TO_STD)
            for shift in range(4):
                size = len(piece) - shift
                if size < _MIN_RUN:
                    break
                tail = size % 4
                if tail == 0:
                    encoded.append(piece[shift:])
                elif tail == 1:
                    encoded.append(piece[shift:-1])
                elif tail == 2:
                    encoded.append(piece[shift:] + _PAD2[piece[-1]])
                else:
                    encoded.append(piece[shift:] + b"A")
    return binascii.a2b_base64(_B64_GAP.join(encoded)) if encoded else b""


_HEX_TABLE = _class_table(_HEX_CHARS)


def _hex_runs(data: bytes, runs: list[tuple[int, int]]) -> bytes:
    """Each hex run (inside a base64 run) decoded at both alignments (it may start with a
    hex-looking character that is not part of it), in one C call."""
    encoded: list[bytes] = []
    for start, end in runs:
        classes = data[start:end].translate(_HEX_TABLE)
        head = classes.find(_RUN_NEEDLE)
        while head >= 0:
            stop = classes.find(0, head + _MIN_RUN)
            if stop < 0:
                stop = len(classes)
            for shift in (0, 1):
                length = (stop - head - shift) // 2 * 2
                if length >= _MIN_RUN:
                    encoded.append(data[start + head + shift : start + head + shift + length])
            head = classes.find(_RUN_NEEDLE, stop)
    return binascii.unhexlify(b"00".join(encoded)) if encoded else b""


_UNICODE_ESCAPE = re.compile(rb"\\u([0-9a-fA-F]{4})")
_SIMPLE_PAIRS = [(b"\\" + key, value) for key, value in _SIMPLE_ESCAPES.items() if key != b"\\"]
_SENTINELS = (b"\x00\x7f\x01\xfe", b"\xff\x01\x7f\x00", b"\x01\xfe\x00\x7f")


def _json_unescape(data: bytes) -> bytes:
    """JSON string escapes undone with C-speed replaces (an LLM prompt holds one every few
    bytes): escaped backslashes are set aside first, so `\\\\n` stays a backslash and an `n`."""
    sentinel = next((item for item in _SENTINELS if item not in data), None)
    if sentinel is None:
        return _JSON_ESCAPE.sub(_unescape, data)  # adversarial: every sentinel present
    data = data.replace(b"\\\\", sentinel)
    for escape, value in _SIMPLE_PAIRS:
        if escape in data:  # a search is cheaper than a copy
            data = data.replace(escape, value)
    if b"\\u" in data:
        # split, so that a \u escape decoding to the sentinel's bytes cannot turn into a backslash
        parts = data.split(sentinel)
        return b"\\".join([_UNICODE_ESCAPE.sub(_unescape_unicode, part) for part in parts])
    return data.replace(sentinel, b"\\")


def _unescape_unicode(match: re.Match[bytes]) -> bytes:
    return chr(int(match.group(1), 16)).encode("utf-8", "surrogatepass")


def _unescape(match: re.Match[bytes]) -> bytes:
    if match.group(1) is not None:
        return chr(int(match.group(1), 16)).encode("utf-8", "surrogatepass")
    return _SIMPLE_ESCAPES[match.group(2)]


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
