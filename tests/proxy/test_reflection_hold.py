"""The reflection guard holds back only what the matcher needs: nothing while no prefix of an
encoded form is pending, and then at most the longest form minus one byte (real Hyperscan)."""

from __future__ import annotations

import base64
import gzip
import json
import random
import zlib

import brotli  # type: ignore[import-untyped]
import pytest
import zstandard

from umbra.proxy.reflection import BodyStream, Reflected, ReflectionGuard
from umbra.proxy.scanner import secret_encodings

VALUE = "Bearer tok-7q2w9e8r1t"


def test_nothing_is_held_while_no_prefix_is_pending() -> None:
    stream = ReflectionGuard([VALUE]).stream("")
    for event in (b"data: event-0\n\n", b"data: event-1\n\n", b"x" * 70000):
        assert stream.feed(event) == event
    assert stream.finish() == b""


def test_a_pending_prefix_is_held_and_released_when_it_breaks() -> None:
    stream = ReflectionGuard([VALUE]).stream("")
    assert stream.feed(b"data: " + VALUE[:9].encode()) == b"data: "
    assert stream.feed(b"!\n\n") == VALUE[:9].encode() + b"!\n\n"


def test_at_most_the_longest_form_minus_one_byte_is_held() -> None:
    longest = max(secret_encodings(VALUE.encode()), key=len)
    stream = ReflectionGuard([VALUE]).stream("")
    out = stream.feed(b"data: " + longest[:-1])
    assert out == b"data: "  # held: exactly the pending prefix, len(longest) - 1 bytes
    with pytest.raises(Reflected):
        stream.feed(longest[-1:])


def test_a_form_split_across_chunks_is_cut_before_its_first_half() -> None:
    form = base64.b64encode(VALUE.encode())
    stream = ReflectionGuard([VALUE]).stream("")
    assert form[:10] not in stream.feed(b"data: " + form[:10])
    with pytest.raises(Reflected):
        stream.feed(form[10:])


@pytest.mark.parametrize("encoding", ["", "gzip", "deflate", "br", "zstd", "gzip, br"])
def test_a_body_ending_in_a_pending_prefix_is_passed_on_whole(encoding: str) -> None:
    """The held tail of a body that ends mid-prefix is released at the end, not dropped: a
    Content-Length response then never waits for bytes that will not come."""
    plain = b"peer port 5638" + VALUE[:9].encode()
    body = _encode(plain, encoding)
    stream = ReflectionGuard([VALUE]).stream(encoding)
    out = b"".join(stream.feed(body[i : i + 7]) for i in range(0, len(body), 7))
    assert out + stream.finish() == body


def test_any_body_without_the_credential_comes_out_byte_for_byte() -> None:
    rng = random.Random(7)
    alphabet = b"Bearer tok-7q2w9e8r1t=/+:" + bytes(range(256))
    for _ in range(300):
        body = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 300)))
        if any(form in body for form in secret_encodings(VALUE.encode())):
            continue
        stream = ReflectionGuard([VALUE]).stream("")
        out, start = b"", 0
        while start < len(body):
            size = rng.randrange(1, 40)
            out += stream.feed(body[start : start + size])
            start += size
        assert out + stream.finish() == body


def test_a_credential_in_the_last_compressed_bytes_is_caught_before_the_end() -> None:
    packed = zlib.compress(b"x" * 100 + VALUE.encode())
    stream = ReflectionGuard([VALUE]).stream("deflate")
    with pytest.raises(Reflected):
        _feed_bytewise_and_finish(stream, packed)


def _feed_bytewise_and_finish(stream: BodyStream, body: bytes) -> bytes:
    out = b"".join(stream.feed(body[i : i + 1]) for i in range(len(body)))
    return out + stream.finish()


def _encode(data: bytes, encoding: str) -> bytes:
    coders = {
        "gzip": gzip.compress,
        "deflate": zlib.compress,
        "br": brotli.compress,
        "zstd": zstandard.ZstdCompressor().compress,
    }
    for name in [part.strip() for part in encoding.split(",") if part.strip()]:
        data = coders[name](data)
    return data


def _feed_all(stream: BodyStream, chunks: list[bytes], passed: list[bytes]) -> None:
    for chunk in chunks:
        passed.append(stream.feed(chunk))


def _split_events(value: str, framing: str) -> list[bytes]:
    middle = len(value) // 2
    if framing == "lines":
        return [
            json.dumps({"delta": value[i : i + 3]}).encode() + b"\n"
            for i in range(0, len(value), 3)
        ]
    return [f"data: {value[:middle]}\n\n".encode(), f"data: {value[middle:]}\n\n".encode()]


@pytest.mark.parametrize(
    ("content_type", "framing"),
    [
        ("text/plain", "sse"),  # server-sent events the content type does not declare
        ("application/octet-stream", "sse"),
        ("", "sse"),
        ("application/x-ndjson", "lines"),  # streamed JSON lines, one delta per line
        ("application/jsonl; charset=utf-8", "lines"),
    ],
)
def test_a_credential_in_pieces_of_any_event_stream_is_cut(content_type: str, framing: str) -> None:
    """Fails on the old code: only a declared `text/event-stream` was split into events, so the
    pieces passed (a client joins them whatever the header says)."""
    stream = ReflectionGuard([VALUE]).stream("", content_type)
    passed: list[bytes] = []
    with pytest.raises(Reflected):
        _feed_all(stream, _split_events(VALUE, framing), passed)
    assert VALUE[:4].encode() not in b"".join(passed)  # the pending start was held, not passed


@pytest.mark.parametrize("first", [b"d", b"data", b"\xef\xbb\xbfdat"])
def test_a_stream_opening_in_tiny_chunks_is_still_recognised(first: bytes) -> None:
    stream = ReflectionGuard([VALUE]).stream("", "text/plain")
    events = b"".join(_split_events(VALUE, "sse"))
    body = first + events[len(first.removeprefix(b"\xef\xbb\xbf")) :]
    with pytest.raises(Reflected):
        _feed_all(stream, [body[index : index + 3] for index in range(0, len(body), 3)], [])


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("text/plain", b"data: Bearer\n\ndata: x\n\n"),
        ("application/x-ndjson", b'{"d": "Bearer"}\n{"d": "x"}\n'),
        ("text/plain", b"Bearer tok-7q2w\n" + b"9e8r1t\n"),  # not events: lines are not joined
    ],
)
def test_streams_that_only_start_like_a_credential_pass_whole(
    content_type: str, body: bytes
) -> None:
    stream = ReflectionGuard([VALUE]).stream("", content_type)
    out = b"".join(stream.feed(body[i : i + 5]) for i in range(0, len(body), 5))
    assert out + stream.finish() == body


def test_a_first_byte_that_opens_no_event_is_passed_at_once() -> None:
    """Only bytes that could still open an event wait for the next chunk (a heartbeat byte of a
    long poll is not delayed)."""
    stream = ReflectionGuard([VALUE]).stream("", "application/json")
    assert stream.feed(b"{") == b"{"
    assert stream.feed(b'"a": 1}') == b'"a": 1}'
    waiting = ReflectionGuard([VALUE]).stream("", "text/plain")
    assert waiting.feed(b"da") == b""  # could be `data:`
    assert waiting.feed(b"y 1\n") == b"day 1\n"
