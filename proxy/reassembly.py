"""Reflection in pieces: an injected credential reassembled from a sequence of events or messages.

A client reads a server-sent-events stream or a WebSocket connection as a sequence of texts (each
event's data, each message) and can join them as it likes: the reflection guard's byte stream sees
`data: Bearer TEAMSEC\\n\\ndata: RET-...` and no form of the credential in it. Here every event or
message is split into pieces (each string value of a JSON document, by its path, so the
`choices[].delta.content` of successive streamed completions join as a client joins them; the
whole text otherwise), and for each path:

- the pieces are concatenated and every encoded form of every injected value
  (`scanner.secret_encodings`: raw, hex, URL, JSON, base64/base64url at each alignment) is looked
  for in the joined text (a credential split into pieces of one encoding);
- each piece is also decoded in every way the request-side scanner knows (base64, base64url, hex,
  URL) and a credential is followed across consecutive pieces whatever each piece's encoding (the
  first half plain, the second base64): a piece ending in a start of the credential, pieces that
  continue it whole, a piece completing it.

A credential completed either way raises `Reflected`. `add` answers whether a start of a
credential at least `MIN_HOLD` bytes long is pending at the end, so the caller holds that text back
until the next piece shows whether it continues (shorter starts pass: at most `MIN_HOLD - 1`
bytes of a credential reach the client before a split reflection is cut).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator, Sequence
from urllib.parse import unquote_to_bytes

from umbra.proxy.scanner import secret_encodings


class Reflected(Exception):
    """The response carries an injected credential (in some form)."""


MIN_HOLD = 4
_MAX_PATHS = 64
_MAX_JSON = 1 << 20
_B64 = re.compile(rb"[A-Za-z0-9+/]+={0,2}")
_B64URL = re.compile(rb"[A-Za-z0-9_-]+={0,2}")
_HEX = re.compile(rb"(?:[0-9a-fA-F]{2})+")


def variants(piece: bytes) -> Iterator[bytes]:
    """The piece and each decoding of it the request-side scanner would try."""
    yield piece
    stripped = piece.strip()
    if len(stripped) >= 2:
        for pattern, decode in ((_B64, base64.b64decode), (_B64URL, base64.urlsafe_b64decode)):
            if pattern.fullmatch(stripped):
                padded = stripped.rstrip(b"=")
                padded += b"=" * (-len(padded) % 4)
                try:
                    decoded = decode(padded)
                except (binascii.Error, ValueError):
                    continue
                yield decoded
        if _HEX.fullmatch(stripped):
            yield bytes.fromhex(stripped.decode("ascii"))
    if b"%" in piece:
        yield unquote_to_bytes(piece)


def _json_pieces(value: object, path: str, out: list[tuple[str, bytes]]) -> None:
    if isinstance(value, str):
        out.append((path, value.encode("utf-8", "surrogatepass")))
    elif isinstance(value, dict):
        for key, item in value.items():
            _json_pieces(item, f"{path}.{key}", out)
    elif isinstance(value, list):
        for item in value:
            _json_pieces(item, f"{path}[]", out)


def pieces(text: bytes) -> list[tuple[str, bytes]]:
    """(path, piece) of one event or message: JSON string values by path, or the whole text."""
    head = text.lstrip()[:1]
    if head in (b"{", b"[") and len(text) <= _MAX_JSON:
        try:
            document = json.loads(text)
        except (ValueError, RecursionError):
            pass
        else:
            out: list[tuple[str, bytes]] = []
            _json_pieces(document, "$", out)
            return out
    return [("", text)]


class Reassembler:
    """One response or connection: `add` each event's or message's text in order."""

    def __init__(self, values: Sequence[str]) -> None:
        self._values = sorted({value.encode() for value in values if value})
        self._forms = sorted({form for value in self._values for form in secret_encodings(value)})
        self._longest = max(len(form) for form in self._forms)
        self._prefixes = {form[:k] for form in self._forms for k in range(MIN_HOLD, len(form))}
        self._tails: dict[str, bytes] = {}
        # path -> {(value index, bytes of it matched so far)}
        self._progress: dict[str, set[tuple[int, int]]] = {}

    def add(self, text: bytes) -> bool:
        """Check one more event or message; raise `Reflected` on a credential, answer whether a
        start of one is pending."""
        pending = False
        for path, piece in pieces(text):
            if path not in self._tails and len(self._tails) >= _MAX_PATHS:
                path = "*"  # bounded state: the rest share one path
            pending |= self._joined(path, piece)
            pending |= self._followed(path, piece)
        return pending

    def _joined(self, path: str, piece: bytes) -> bool:
        tail = self._tails.get(path, b"") + piece
        if any(form in tail for form in self._forms):
            raise Reflected("response reflects an injected credential split across events")
        tail = tail[-(self._longest - 1) :] if self._longest > 1 else b""
        self._tails[path] = tail
        return any(tail[-size:] in self._prefixes for size in range(MIN_HOLD, len(tail) + 1))

    def _followed(self, path: str, piece: bytes) -> bool:
        before = self._progress.get(path, set())
        after: set[tuple[int, int]] = set()
        for variant in variants(piece):
            if not variant:
                continue
            for index, value in enumerate(self._values):
                for number, matched in before:
                    if number != index:
                        continue
                    rest = value[matched:]
                    if variant.startswith(rest):
                        raise Reflected("response reflects an injected credential in pieces")
                    if rest.startswith(variant):
                        after.add((index, matched + len(variant)))
                # a start of the credential at the end of this piece
                for size in range(min(len(variant), len(value) - 1), 0, -1):
                    if variant.endswith(value[:size]):
                        after.add((index, size))
        self._progress[path] = after
        return any(matched >= MIN_HOLD for _, matched in after)
