"""The server side of RFC 6455 WebSocket framing, just enough for the vendor stand-in to answer
Codex's Responses WebSocket (cli/vendor_origin.py): the handshake's accept key, reading a
client's (masked, possibly fragmented) message, sending text, pong and close frames. No
extensions are negotiated (no permessage-deflate), so payloads are plain. Tests only."""

from __future__ import annotations

import base64
import hashlib
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
MAX_MESSAGE = 8 << 20


class Reader(Protocol):
    def read(self, size: int, /) -> bytes: ...


class Opcode(IntEnum):
    CONTINUATION = 0x0
    TEXT = 0x1
    BINARY = 0x2
    CLOSE = 0x8
    PING = 0x9
    PONG = 0xA


class FrameError(Exception):
    """A frame the stand-in will not take (unmasked, oversized, a bad continuation)."""


@dataclass(frozen=True, slots=True)
class Message:
    opcode: Opcode
    payload: bytes


def accept_key(key: str) -> str:
    """`Sec-WebSocket-Accept` for a handshake's `Sec-WebSocket-Key`."""
    digest = hashlib.sha1((key.strip() + _GUID).encode(), usedforsecurity=False).digest()
    return base64.b64encode(digest).decode()


def _exactly(stream: Reader, size: int) -> bytes:
    data = stream.read(size) if size else b""
    if len(data) != size:
        raise EOFError("the connection closed inside a frame")
    return data


def _frame(stream: Reader) -> tuple[bool, int, bytes]:
    first, second = _exactly(stream, 2)
    size = second & 0x7F
    if size == 126:
        (size,) = struct.unpack("!H", _exactly(stream, 2))
    elif size == 127:
        (size,) = struct.unpack("!Q", _exactly(stream, 8))
    if not second & 0x80:
        raise FrameError("a client frame must be masked")
    if size > MAX_MESSAGE:
        raise FrameError("frame too large")
    mask = _exactly(stream, 4)
    payload = bytes(b ^ mask[i % 4] for i, b in enumerate(_exactly(stream, size)))
    return bool(first & 0x80), first & 0x0F, payload


def read_message(stream: Reader) -> Message:
    """The next message: a control frame as it comes, or a data message with its fragments."""
    fin, opcode, payload = _frame(stream)
    if opcode >= Opcode.CLOSE:
        return Message(Opcode(opcode), payload)
    if opcode == Opcode.CONTINUATION:
        raise FrameError("a continuation frame without a message")
    parts = [payload]
    while not fin:
        fin, more, payload = _frame(stream)
        if more >= Opcode.CLOSE:  # a control frame between fragments: not expected from Codex
            raise FrameError("control frame inside a fragmented message")
        if more != Opcode.CONTINUATION:
            raise FrameError("a new message inside a fragmented one")
        parts.append(payload)
        if sum(map(len, parts)) > MAX_MESSAGE:
            raise FrameError("message too large")
    return Message(Opcode(opcode), b"".join(parts))


def frame(opcode: Opcode, payload: bytes) -> bytes:
    """One unmasked, final frame (the server's)."""
    size = len(payload)
    if size < 126:
        head = struct.pack("!BB", 0x80 | opcode, size)
    elif size < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, 126, size)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 127, size)
    return head + payload
