"""Transparent mode: learn where a sandbox connection to the forwarder's :443 or :80 was going.

The sandbox's resolver answers every name with the forwarder's address (dns_responder.py), so a
tool that ignores proxy variables connects here. The destination name comes from what the client
sends first: the TLS ClientHello's SNI on :443, the HTTP request head's `Host` on :80. These bytes
are read (bounded in size and time) but nothing is sent anywhere until the Security CVM is
attested; then the forwarder asks the proxy for `CONNECT name:port` and replays them, so the
proxy's name checks, policy and records apply exactly as to proxied traffic.

A name must be a plain DNS name: no SNI, an IP literal, or anything that is not letters, digits,
`-`, `_` and dots is refused here (the connection closes, one log line, a stats counter).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import struct
from collections.abc import Awaitable, Callable
from enum import StrEnum

MAX_CLIENT_HELLO = 32 * 1024  # several records' worth (post-quantum key shares are ~1.2 KiB)
MAX_REQUEST_HEAD = 16 * 1024
PEEK_TIMEOUT = 10.0

_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_NAME = re.compile(rf"^(?:{_LABEL}\.)*{_LABEL}$")


class Refusal(StrEnum):
    """Why a transparent connection was closed before anything was sent (ForwarderStats)."""

    NO_SNI = "transparent_no_sni"
    IP_LITERAL = "transparent_ip_literal"
    BAD_NAME = "transparent_bad_name"
    NOT_TLS = "transparent_not_tls"
    NO_HOST = "transparent_no_host"
    NOT_HTTP = "transparent_not_http"
    TOO_LARGE = "transparent_too_large"
    TIMEOUT = "transparent_timeout"
    PROXY_REFUSED = "transparent_proxy_refused"


class Refused(Exception):
    def __init__(self, reason: Refusal, detail: str = "") -> None:
        super().__init__(detail or reason.value)
        self.reason = reason


def check_name(raw: bytes | str, *, empty: Refusal) -> str:
    """A lower-case DNS name fit for `CONNECT name:port`, or Refused."""
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    name = text.strip().lower().removesuffix(".")
    if not name:
        raise Refused(empty)
    if name.startswith("[") or _is_ip_literal(name):
        raise Refused(Refusal.IP_LITERAL, f"{name[:64]!r} is an address, not a name")
    if len(name) > 253 or not _NAME.match(name):
        raise Refused(Refusal.BAD_NAME, f"{name[:64]!r} is not a DNS name")
    return name


def _is_ip_literal(name: str) -> bool:
    # The last label all digits (or hex with 0x) is how resolvers tell an IPv4 literal, in any of
    # its forms (10.1, 0x7f.1, 2130706433).
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    last = name.rsplit(".", 1)[-1]
    return last.isdigit() or bool(re.fullmatch(r"0x[0-9a-f]*", last))


def sni_from_client_hello(data: bytes) -> str | None:
    """The host_name of the server_name extension of a complete ClientHello handshake message
    (`data` = the handshake message: type, 3-byte length, body), None when it has none. Raises
    ValueError when the message is malformed."""
    if len(data) < 4 or data[0] != 1:
        raise ValueError("not a ClientHello")
    body = data[4 : 4 + int.from_bytes(data[1:4], "big")]
    pos = 2 + 32  # legacy_version, random
    pos = _skip(body, pos, 1)  # legacy_session_id
    pos = _skip(body, pos, 2)  # cipher_suites
    pos = _skip(body, pos, 1)  # legacy_compression_methods
    if pos == len(body):
        return None  # no extensions at all
    end = pos + 2 + _length(body, pos, 2)
    if end > len(body):
        raise ValueError("extensions overrun the ClientHello")
    pos += 2
    while pos < end:
        if pos + 4 > end:
            raise ValueError("truncated extension")
        ext_type, ext_len = struct.unpack_from("!HH", body, pos)
        pos += 4
        if pos + ext_len > end:
            raise ValueError("extension overruns the list")
        if ext_type == 0:
            return _host_name(body[pos : pos + ext_len])
        pos += ext_len
    return None


def _length(buf: bytes, pos: int, size: int) -> int:
    if pos + size > len(buf):
        raise ValueError("truncated length")
    return int.from_bytes(buf[pos : pos + size], "big")


def _skip(buf: bytes, pos: int, size: int) -> int:
    pos = pos + size + _length(buf, pos, size)
    if pos > len(buf):
        raise ValueError("field overruns the ClientHello")
    return pos


def _host_name(ext: bytes) -> str | None:
    if len(ext) < 2 or 2 + _length(ext, 0, 2) != len(ext):
        raise ValueError("malformed server_name list")
    pos = 2
    while pos < len(ext):
        if pos + 3 > len(ext):
            raise ValueError("truncated server_name entry")
        kind, size = ext[pos], _length(ext, pos + 1, 2)
        name = ext[pos + 3 : pos + 3 + size]
        if len(name) != size:
            raise ValueError("truncated server_name")
        if kind == 0:
            return name.decode("ascii", "replace")
        pos += 3 + size
    return None


async def read_client_hello(reader: asyncio.StreamReader) -> tuple[bytes, str]:
    """Read TLS records until the ClientHello is complete; return (every byte read, the name)."""
    seen = bytearray()
    handshake = bytearray()
    while True:
        try:
            head = await reader.readexactly(5)
        except asyncio.IncompleteReadError:
            raise Refused(Refusal.NOT_TLS, "closed before a ClientHello") from None
        content_type, _version, length = struct.unpack("!BHH", head)
        if content_type != 22 or not 0 < length <= 16384 + 2048:
            raise Refused(Refusal.NOT_TLS, "not a TLS handshake record")
        if len(seen) + 5 + length > MAX_CLIENT_HELLO:
            raise Refused(Refusal.TOO_LARGE, "ClientHello larger than the forwarder reads")
        try:
            fragment = await reader.readexactly(length)
        except asyncio.IncompleteReadError:
            raise Refused(Refusal.NOT_TLS, "closed inside a TLS record") from None
        seen += head + fragment
        handshake += fragment
        if len(handshake) >= 4 and len(handshake) >= 4 + int.from_bytes(handshake[1:4], "big"):
            break
    try:
        sni = sni_from_client_hello(bytes(handshake))
    except ValueError as exc:
        raise Refused(Refusal.NOT_TLS, str(exc)) from None
    if sni is None:
        raise Refused(Refusal.NO_SNI, "TLS without SNI")
    return bytes(seen), check_name(sni, empty=Refusal.NO_SNI)


def host_from_request_head(head: bytes) -> str:
    """The name in the one `Host` header of an HTTP/1 request head (port dropped: the proxy checks
    that a port, if given, is the connect port)."""
    lines = head.split(b"\r\n")
    request_line = lines[0].split(b" ")
    if len(request_line) != 3 or not request_line[2].startswith(b"HTTP/1."):
        raise Refused(Refusal.NOT_HTTP, "not an HTTP/1 request line")
    hosts = [line.split(b":", 1)[1] for line in lines[1:] if line[:5].lower() == b"host:"]
    if len(hosts) != 1:
        raise Refused(Refusal.NO_HOST, f"{len(hosts)} Host headers")
    value = hosts[0].strip()
    if value.startswith(b"["):
        raise Refused(Refusal.IP_LITERAL, "an IPv6 literal Host")
    name = value.rsplit(b":", 1)[0] if value.count(b":") == 1 else value
    return check_name(name, empty=Refusal.NO_HOST)


async def read_request_head(reader: asyncio.StreamReader) -> tuple[bytes, str]:
    """Read the HTTP request head (to the blank line); return (every byte read, the name)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise Refused(Refusal.TOO_LARGE, "request head larger than the forwarder reads") from None
    except asyncio.IncompleteReadError:
        raise Refused(Refusal.NOT_HTTP, "closed before a complete request head") from None
    return head, host_from_request_head(head)


def connect_request(name: str, port: int) -> bytes:
    target = f"{name}:{port}"
    return f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()


async def read_connect_reply(
    recv: Callable[[], Awaitable[bytes]], limit: int = 8192
) -> tuple[int, bytes, bytes]:
    """(status, head, bytes after the head) of the proxy's answer to our CONNECT."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        if len(buf) > limit:
            raise Refused(Refusal.PROXY_REFUSED, "oversized CONNECT reply")
        chunk = await recv()
        if not chunk:
            raise Refused(Refusal.PROXY_REFUSED, "the proxy closed the session")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    parts = head.split(b"\r\n", 1)[0].split()
    status = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0
    return status, head + b"\r\n\r\n", rest
