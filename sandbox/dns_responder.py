"""The sandbox's resolver: every name is the forwarder (stdlib only, never sends a query anywhere).

The sandbox has no route out, so a real resolver would only be an exfiltration channel (queries
carry names). Instead the forwarder answers every `A` question with its own sandbox-side address,
so a tool that ignores proxy variables connects to the forwarder's transparent listeners, which
take the destination from the TLS SNI or the HTTP `Host` and hand it to the Security CVM's proxy
(docs/specs/sandbox.md, "DNS and transparent mode"). The real resolution happens there, checked.

Answers: `A` (class IN) -> the forwarder's address; any other type of class IN -> NOERROR with no
answer (NODATA: "no such record", so AAAA/HTTPS/MX lookups end at once); `ANY`, zone transfers
and other classes -> REFUSED; another opcode -> NOTIMP. Malformed packets, responses, and
queries over the rate limit get nothing. A reply is at most the question plus one 16-byte answer
(no EDNS, no additional records), never larger than 12 + 259 + 16 bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import struct
import time
from dataclasses import dataclass, field
from enum import IntEnum

logger = logging.getLogger(__name__)

HEADER = struct.Struct("!HHHHHH")
MAX_QUESTION_NAME = 255  # wire length, RFC 1035 2.3.4
MAX_TCP_MESSAGE = 512  # a query is a header and one question: anything longer is not ours
TCP_IDLE = 10.0
TCP_MAX_QUERIES = 64
TCP_MAX_CONNECTIONS = 16
TTL = 60

TYPE_A = 1
CLASS_IN = 1
# Types answered REFUSED rather than NODATA: ANY (RFC 8482 lets a server decline), zone transfers.
REFUSED_TYPES = frozenset({251, 252, 253, 254, 255})


class Rcode(IntEnum):
    NOERROR = 0
    FORMERR = 1
    NOTIMP = 4
    REFUSED = 5


@dataclass
class DnsStats:
    answered: int = 0
    nodata: int = 0
    refused: int = 0
    notimp: int = 0
    dropped_malformed: int = 0
    dropped_rate: int = 0


@dataclass
class TokenBucket:
    """At most `rate` answers a second on average, `burst` at once; the excess is dropped."""

    rate: float
    burst: float
    _tokens: float = -1.0
    _last: float = field(default_factory=time.monotonic)

    def take(self) -> bool:
        now = time.monotonic()
        if self._tokens < 0:
            self._tokens = self.burst
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


def _question_end(packet: bytes) -> int | None:
    """The offset after the one question's QNAME, or None when it is malformed (compression
    pointers are not allowed in a query's question, labels are at most 63 bytes, the name 255)."""
    offset = HEADER.size
    while True:
        if offset >= len(packet):
            return None
        length = packet[offset]
        if length == 0:
            offset += 1
            break
        if length > 63:
            return None
        offset += 1 + length
        if offset - HEADER.size > MAX_QUESTION_NAME - 1:
            return None
    if offset + 4 > len(packet):
        return None
    return offset


def answer(
    query: bytes, address: ipaddress.IPv4Address, stats: DnsStats | None = None
) -> bytes | None:
    """The reply to one DNS query message, or None to stay silent."""
    stats = stats if stats is not None else DnsStats()
    if len(query) < HEADER.size:
        stats.dropped_malformed += 1
        return None
    ident, flags, qdcount, ancount, nscount, _arcount = HEADER.unpack_from(query)
    if flags & 0x8000:  # a response: never answer one (no loops, no reflection)
        stats.dropped_malformed += 1
        return None
    opcode = (flags >> 11) & 0xF
    rd = flags & 0x0100
    if opcode != 0:
        stats.notimp += 1
        return HEADER.pack(ident, 0x8000 | (opcode << 11) | rd | Rcode.NOTIMP, 0, 0, 0, 0)
    if qdcount != 1 or ancount or nscount:
        stats.dropped_malformed += 1
        return None
    end = _question_end(query)
    if end is None:
        stats.dropped_malformed += 1
        return None
    question = query[HEADER.size : end + 4]
    qtype, qclass = struct.unpack_from("!HH", query, end)
    # QR, AA, RD copied; no RA: this server recurses nowhere.
    base = 0x8000 | 0x0400 | rd
    if qclass != CLASS_IN or qtype in REFUSED_TYPES:
        stats.refused += 1
        return HEADER.pack(ident, base | Rcode.REFUSED, 1, 0, 0, 0) + question
    if qtype != TYPE_A:
        stats.nodata += 1
        return HEADER.pack(ident, base | Rcode.NOERROR, 1, 0, 0, 0) + question
    stats.answered += 1
    record = struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, TTL, 4) + address.packed
    return HEADER.pack(ident, base | Rcode.NOERROR, 1, 1, 0, 0) + question + record


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, responder: DnsResponder) -> None:
        self.responder = responder
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.DatagramTransport)
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = self.responder.reply(data)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)

    def error_received(self, exc: Exception) -> None:
        logger.debug("dns: %s", exc)


@dataclass
class DnsResponder:
    """UDP and TCP on `host:port`: `host` is the forwarder's sandbox-side address (never a
    wildcard), and it is also the one answer."""

    host: str
    port: int = 53
    rate: float = 500.0
    burst: float = 1000.0
    stats: DnsStats = field(default_factory=DnsStats)
    _address: ipaddress.IPv4Address | None = None
    _bucket: TokenBucket | None = None
    _udp: asyncio.DatagramTransport | None = None
    _tcp: asyncio.Server | None = None
    _tcp_slots: asyncio.Semaphore | None = None

    async def start(self) -> None:
        address = ipaddress.ip_address(self.host)
        if not isinstance(address, ipaddress.IPv4Address) or address.is_unspecified:
            raise ValueError("the DNS responder binds one specific IPv4 address")
        self._address = address
        self._bucket = TokenBucket(self.rate, self.burst)
        self._tcp_slots = asyncio.Semaphore(TCP_MAX_CONNECTIONS)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Udp(self), local_addr=(self.host, self.port)
        )
        self._udp = transport
        try:
            self._tcp = await asyncio.start_server(self._serve_tcp, self.host, self.port)
        except OSError:
            transport.close()
            raise

    def bound_port(self) -> int:
        assert self._udp is not None
        return int(self._udp.get_extra_info("sockname")[1])

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            with contextlib.suppress(Exception):
                await self._tcp.wait_closed()

    def reply(self, query: bytes) -> bytes | None:
        assert self._bucket is not None and self._address is not None
        if len(query) > MAX_TCP_MESSAGE * 8:  # larger than any UDP query we could answer
            self.stats.dropped_malformed += 1
            return None
        if not self._bucket.take():
            self.stats.dropped_rate += 1
            return None
        return answer(query, self._address, self.stats)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._tcp_slots is not None
        if self._tcp_slots.locked():
            writer.close()
            return
        async with self._tcp_slots:
            try:
                for _ in range(TCP_MAX_QUERIES):
                    size = struct.unpack(
                        "!H", await asyncio.wait_for(reader.readexactly(2), TCP_IDLE)
                    )[0]
                    if not HEADER.size <= size <= MAX_TCP_MESSAGE:
                        self.stats.dropped_malformed += 1
                        break
                    query = await asyncio.wait_for(reader.readexactly(size), TCP_IDLE)
                    reply = self.reply(query)
                    if reply is None:
                        break
                    writer.write(struct.pack("!H", len(reply)) + reply)
                    await writer.drain()
            except (asyncio.IncompleteReadError, TimeoutError, ConnectionError, OSError):
                pass
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
