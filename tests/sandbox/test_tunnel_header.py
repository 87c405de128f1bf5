"""The identity header codec: what the forwarder writes, the tunnel endpoint reads exactly."""

from __future__ import annotations

import json
import struct

import pytest

from umbra.contracts.tunnel_header import (
    MAX_CA_REPLY,
    MAX_HEADER,
    HeaderError,
    TunnelHeader,
    encode_ca_reply,
    encode_header,
    read_ca_reply,
    read_header,
)


def _reader(data: bytes, step: int = 3):  # type: ignore[no-untyped-def]
    buf = bytearray(data)

    async def recv(n: int) -> bytes:
        out = bytes(buf[: min(n, step)])
        del buf[: len(out)]
        return out

    return recv


async def test_round_trip_in_small_pieces_leaves_following_bytes() -> None:
    h = TunnelHeader("dev-alice-1", "tunnel", "github-ssh", "github.com", 22, credential="c" * 20)
    raw = encode_header(h)
    body = json.loads(raw[4:])
    assert body == {"v": 1, "cvm_id": "dev-alice-1", "mode": "tunnel", "tunnel": "github-ssh",
                    "host": "github.com", "port": 22, "credential": "c" * 20}  # fmt: skip
    assert raw[4:] == json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    recv = _reader(raw + b"SSH-2.0-x", step=5)
    got, rest = await read_header(recv)
    # It never reads past the header: the sandbox's bytes stay in the stream, untouched.
    assert got == h and rest == b""
    assert await recv(64) == b"SSH-2"


def _frame(doc: object) -> bytes:
    body = json.dumps(doc).encode()
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (_frame({"v": 2, "cvm_id": "a", "mode": "proxy"}), "version"),
        (_frame({"v": 1, "cvm_id": "a", "mode": "proxy", "admin": True}), "unknown header fields"),
        (_frame({"v": 1, "cvm_id": "a b", "mode": "proxy"}), "cvm_id must match"),
        (_frame({"v": 1, "cvm_id": "a", "mode": "proxy", "host": "x.com"}), "no destination"),
        (_frame({"v": 1, "cvm_id": "a", "mode": "tunnel", "tunnel": "t", "host": "x.com"}), "port"),
        (_frame({"v": 1, "cvm_id": "a", "mode": "tunnel", "tunnel": "t", "host": "x.com", "port": "22"}), "integer"),
        (_frame({"v": 1, "cvm_id": "a", "mode": "raw"}), "mode"),
        (_frame([1]), "object"),
        (struct.pack(">I", MAX_HEADER + 1), "outside"),
        (_frame({"v": 1, "cvm_id": "a", "mode": "proxy"})[:-2], "closed before"),
    ],
)  # fmt: skip
async def test_malformed_headers_are_refused(raw: bytes, expected: str) -> None:
    with pytest.raises(HeaderError, match=expected):
        await read_header(_reader(raw))


async def test_ca_mode_and_its_bounded_reply() -> None:
    h = TunnelHeader("dev-alice-1", "ca", credential="c" * 20)
    got, rest = await read_header(_reader(encode_header(h)))
    assert got == h and rest == b""
    with pytest.raises(HeaderError, match="ca mode carries no destination"):
        TunnelHeader("dev-alice-1", "ca", host="github.com", port=22)
    pem = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    assert await read_ca_reply(_reader(encode_ca_reply(pem) + b"trailing", step=7)) == pem
    # Both sides share one bound; a longer claim is refused before anything is buffered.
    with pytest.raises(HeaderError, match="outside"):
        await read_ca_reply(_reader(struct.pack(">I", MAX_CA_REPLY + 1) + b"x" * 10))
    with pytest.raises(HeaderError, match="outside"):
        encode_ca_reply(b"")
    with pytest.raises(HeaderError, match="closed before the whole CA reply"):
        await read_ca_reply(_reader(encode_ca_reply(pem)[:-3]))
