"""The reflection guard holds back only what the matcher needs: nothing while no prefix of an
encoded form is pending, and then at most the longest form minus one byte (real Hyperscan)."""

from __future__ import annotations

import base64

import pytest

from umbra.proxy.reflection import Reflected, ReflectionGuard
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
