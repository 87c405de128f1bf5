"""`proxy/usage.py` on its own: events split anywhere between chunks, oversized events skipped
(not kept), both APIs' field names, and usage that is not believable."""

from __future__ import annotations

import json

import pytest

from tests.proxy.test_usage import ANTHROPIC_STREAM, OPENAI_STREAM
from umbra.contracts.traffic import MAX_TOKENS
from umbra.proxy.usage import MAX_EVENT, UsageReader, provider_of


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1 << 20])
def test_an_event_stream_split_at_any_byte_reads_the_same(size: int) -> None:
    stream = b"".join(ANTHROPIC_STREAM)
    reader = UsageReader(event_stream=True)
    for start in range(0, len(stream), size):
        reader.feed(stream[start : start + size])
    reader.finish()
    assert reader.record_fields() == {
        "llm_model": "claude-sonnet-4-5",
        "llm_input_tokens": 1200,
        "llm_output_tokens": 321,
        "llm_cache_read_tokens": 800,
        "llm_cache_write_tokens": 40,
    }


def test_openai_chunks_and_done() -> None:
    reader = UsageReader(event_stream=True)
    for event in OPENAI_STREAM:
        reader.feed(event)
    reader.finish()
    assert reader.record_fields() == {
        "llm_model": "gpt-5", "llm_input_tokens": 90, "llm_output_tokens": 12,
        "llm_cache_read_tokens": 64,
    }  # fmt: skip


def test_an_oversized_event_is_skipped_not_kept() -> None:
    reader = UsageReader(event_stream=True)
    reader.feed(b"data: " + b"x" * (MAX_EVENT + 10))
    assert len(reader._pending) == 0
    reader.feed(b"\n\n" + ANTHROPIC_STREAM[0])
    reader.finish()
    assert reader.record_fields()["llm_input_tokens"] == 1200


@pytest.mark.parametrize(
    ("usage", "fragment"),
    [
        ({"input_tokens": -1}, "out of range"),
        ({"output_tokens": MAX_TOKENS + 1}, "out of range"),
        ({"output_tokens": 1.5}, "not an integer"),
        ({"prompt_tokens": "9"}, "not an integer"),
        ({"completion_tokens": False}, "not an integer"),
    ],
)
def test_usage_that_is_not_believable(usage: dict[str, object], fragment: str) -> None:
    reader = UsageReader(event_stream=False)
    reader.feed(json.dumps({"model": "m", "usage": usage}).encode())
    reader.finish()
    assert reader.invalid is not None and fragment in reader.invalid
    assert reader.record_fields() == {}


def test_provider_by_path() -> None:
    assert provider_of("/v1/messages?beta=true") == "anthropic"
    assert provider_of("/openai/deployments/x/chat/completions") == "openai"
    assert provider_of("/v1/responses") == "openai"
    assert provider_of("/v1/models") is None
