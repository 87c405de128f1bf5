"""The sandbox's DNS responder and the transparent listeners' parsers, on loopback and real bytes.

ClientHellos come from Python's real TLS stack (a MemoryBIO handshake), not hand-made bytes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umbra.sandbox.dns_responder import DnsResponder, DnsStats, TokenBucket, answer
from umbra.sandbox.forwarder_config import Listen
from umbra.sandbox.transparent import (
    Refusal,
    Refused,
    check_name,
    host_from_request_head,
    read_client_hello,
    sni_from_client_hello,
)

FWD = ipaddress.IPv4Address("10.231.7.1")


def query(
    name: str, qtype: int = 1, qclass: int = 1, ident: int = 0x1234, flags: int = 0x0100
) -> bytes:
    qname = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".") if p) + b"\0"
    return (
        struct.pack("!HHHHHH", ident, flags, 1, 0, 0, 0) + qname + struct.pack("!HH", qtype, qclass)
    )


def parse(reply: bytes) -> tuple[int, int, int, list[bytes]]:
    ident, flags, qd, an, _ns, _ar = struct.unpack_from("!HHHHHH", reply)
    pos = 12
    while reply[pos]:
        pos += 1 + reply[pos]
    pos += 5
    answers = []
    for _ in range(an):
        _ptr, _t, _c, _ttl, size = struct.unpack_from("!HHHIH", reply, pos)
        answers.append(reply[pos + 12 : pos + 12 + size])
        pos += 12 + size
    assert pos == len(reply), "nothing after the answers"
    return ident, flags & 0xF, qd, answers


def test_every_name_is_the_forwarder() -> None:
    for name in ("pypi.org", "a.b.c.d.example", "x" * 63 + ".test", "localhost"):
        ident, rcode, qd, answers = parse(answer(query(name), FWD) or b"")
        assert (ident, rcode, qd, answers) == (0x1234, 0, 1, [FWD.packed])


@pytest.mark.parametrize("qtype", [28, 65, 15, 16, 12, 33])  # AAAA HTTPS MX TXT PTR SRV
def test_other_types_are_nodata(qtype: int) -> None:
    _ident, rcode, qd, answers = parse(answer(query("pypi.org", qtype), FWD) or b"")
    assert (rcode, qd, answers) == (0, 1, [])


@pytest.mark.parametrize(("qtype", "qclass"), [(255, 1), (252, 1), (251, 1), (1, 3), (1, 255)])
def test_any_transfers_and_other_classes_are_refused(qtype: int, qclass: int) -> None:
    _ident, rcode, _qd, answers = parse(answer(query("pypi.org", qtype, qclass), FWD) or b"")
    assert (rcode, answers) == (5, [])


def test_other_opcodes_are_notimp_without_echo() -> None:
    reply = answer(query("pypi.org", flags=0x2800), FWD)  # opcode 5 (UPDATE)
    assert reply is not None and len(reply) == 12 and reply[3] & 0xF == 4


@pytest.mark.parametrize(
    "packet",
    [
        b"",
        b"\x00" * 11,
        query("pypi.org", flags=0x8100),  # a response
        query("pypi.org")[:-1],  # truncated type/class
        struct.pack("!HHHHHH", 1, 0x100, 2, 0, 0, 0) + query("a.b")[12:] * 2,  # two questions
        struct.pack("!HHHHHH", 1, 0x100, 1, 1, 0, 0) + query("a.b")[12:],  # an answer in a query
        struct.pack("!HHHHHH", 1, 0x100, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01",  # pointer
        struct.pack("!HHHHHH", 1, 0x100, 1, 0, 0, 0) + b"\x40" + b"a" * 64 + b"\0\0\1\0\1",
        struct.pack("!HHHHHH", 1, 0x100, 1, 0, 0, 0) + (b"\x3f" + b"a" * 63) * 5 + b"\0\0\1\0\1",
    ],
)
def test_malformed_packets_get_no_answer(packet: bytes) -> None:
    stats = DnsStats()
    assert answer(packet, FWD, stats) is None
    assert stats.dropped_malformed == 1


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_never_crash_and_never_amplify(packet: bytes) -> None:
    reply = answer(packet, FWD)
    if reply is not None:
        # One question echoed plus at most one 16-byte answer: never more than the query + 16.
        assert len(reply) <= len(packet) + 16 and len(reply) <= 12 + 259 + 16


def test_edns_queries_are_answered_without_the_opt_record() -> None:
    opt = b"\x00\x00\x29\x10\x00\x00\x00\x00\x00\x00\x00"
    packet = bytearray(query("pypi.org") + opt)
    packet[11] = 1  # ARCOUNT
    reply = answer(bytes(packet), FWD) or b""
    assert parse(reply)[3] == [FWD.packed] and len(reply) < len(packet) + 16


def test_token_bucket_drops_the_excess() -> None:
    bucket = TokenBucket(rate=0.001, burst=5)
    assert [bucket.take() for _ in range(8)] == [True] * 5 + [False] * 3


def test_responder_over_udp_and_tcp_on_loopback() -> None:
    async def scenario() -> tuple[bytes, bytes, DnsStats]:
        responder = DnsResponder("127.0.0.1", 0)
        await responder.start()
        port = responder.bound_port()
        assert responder._tcp is not None
        tcp_port = responder._tcp.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.setblocking(False)
            await loop.sock_sendto(udp, query("files.pythonhosted.org"), ("127.0.0.1", port))
            udp_reply = await asyncio.wait_for(loop.sock_recv(udp, 4096), 5)
        reader, writer = await asyncio.open_connection("127.0.0.1", tcp_port)
        q = query("deb.debian.org")
        writer.write(struct.pack("!H", len(q)) + q)
        size = struct.unpack("!H", await reader.readexactly(2))[0]
        tcp_reply = await reader.readexactly(size)
        writer.close()
        await responder.close()
        return udp_reply, tcp_reply, responder.stats

    udp_reply, tcp_reply, stats = asyncio.run(scenario())
    assert parse(udp_reply)[3] == [bytes([127, 0, 0, 1])]
    assert parse(tcp_reply)[3] == [bytes([127, 0, 0, 1])]
    assert stats.answered == 2


def test_responder_refuses_a_wildcard_address() -> None:
    with pytest.raises(ValueError, match="specific IPv4"):
        asyncio.run(DnsResponder("0.0.0.0", 0).start())  # noqa: S104 -- the refusal under test


def client_hello(server_hostname: str | None) -> bytes:
    ctx = ssl.create_default_context()
    if server_hostname is None:
        ctx.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def _read(data: bytes) -> tuple[bytes, str]:
    async def go() -> tuple[bytes, str]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_client_hello(reader)

    return asyncio.run(go())


def test_sni_from_a_real_client_hello() -> None:
    hello = client_hello("Files.PythonHosted.org")
    seen, name = _read(hello)
    assert (seen, name) == (hello, "files.pythonhosted.org")
    assert sni_from_client_hello(hello[5:]) == "Files.PythonHosted.org"


def test_client_hello_split_across_records_is_reassembled() -> None:
    hello = client_hello("pypi.org")
    body = hello[5:]
    records = b"".join(
        b"\x16\x03\x01" + struct.pack("!H", len(part)) + part
        for part in (body[:40], body[40:90], body[90:])
    )
    assert _read(records)[1] == "pypi.org"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (client_hello(None), Refusal.NO_SNI),
        (b"GET / HTTP/1.1\r\nHost: pypi.org\r\n\r\n", Refusal.NOT_TLS),
        (b"\x16\x03\x01\x00\x10" + b"\x01\x00\x00\x0c" + b"\x03\x03", Refusal.NOT_TLS),
        (b"\x16\x03\x01\x40\x00" * 3, Refusal.NOT_TLS),
    ],
)
def test_client_hello_refusals(data: bytes, reason: Refusal) -> None:
    with pytest.raises(Refused) as caught:
        _read(data)
    assert caught.value.reason is reason


def test_ip_literal_sni_is_refused() -> None:
    # Python's TLS never sends an address as SNI; a hostile client can: build one by hand.
    hello = bytearray(client_hello("aaaaaaaa.b"))
    at = hello.find(b"aaaaaaaa.b")
    hello[at : at + 10] = b"10.0.0.1.2"  # same length, an IPv4 literal's form
    with pytest.raises(Refused) as caught:
        _read(bytes(hello))
    assert caught.value.reason is Refusal.IP_LITERAL


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", Refusal.NO_HOST),
        ("127.0.0.1", Refusal.IP_LITERAL),
        ("2130706433", Refusal.IP_LITERAL),
        ("0x7f.1", Refusal.IP_LITERAL),
        ("::1", Refusal.IP_LITERAL),
        ("evil.test\r\nX: y", Refusal.BAD_NAME),
        ("a b.test", Refusal.BAD_NAME),
        ("a..test", Refusal.BAD_NAME),
        ("-a.test", Refusal.BAD_NAME),
        ("a" * 64 + ".test", Refusal.BAD_NAME),
    ],
)
def test_names_that_never_become_a_connect_target(name: str, reason: Refusal) -> None:
    with pytest.raises(Refused) as caught:
        check_name(name, empty=Refusal.NO_HOST)
    assert caught.value.reason is reason


def test_host_header_parsing() -> None:
    head = b"GET /debian/dists/ HTTP/1.1\r\nUser-Agent: apt\r\nHOST: Deb.Debian.org:80\r\n\r\n"
    assert host_from_request_head(head) == "deb.debian.org"
    for bad, reason in (
        (b"GET / HTTP/1.1\r\n\r\n", Refusal.NO_HOST),
        (b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n", Refusal.NO_HOST),
        (b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n", Refusal.IP_LITERAL),
        (b"\x16\x03\x01 junk\r\n\r\n", Refusal.NOT_HTTP),
        (b"GET / HTTP/2\r\nHost: a.test\r\n\r\n", Refusal.NOT_HTTP),
    ):
        with pytest.raises(Refused) as caught:
            host_from_request_head(bad)
        assert caught.value.reason is reason


def test_listen_ports_must_be_distinct() -> None:
    base = {"host": "10.231.1.1", "proxy_port": 3128}
    Listen.model_validate({**base, "transparent": {}, "dns_port": 53})
    with pytest.raises(ValueError, match="distinct"):
        Listen.model_validate({**base, "transparent": {"https_port": 3128}})
    with pytest.raises(ValueError, match="IPv4"):
        Listen.model_validate({"host": "fd00::1", "proxy_port": 3128, "dns_port": 53})
