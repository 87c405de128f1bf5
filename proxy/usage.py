"""LLM usage from Anthropic- and OpenAI-shaped API responses, read beside the stream.

`UsageReader` is fed the response body as it passes (nothing is held back) and keeps only what
it needs: for an event stream, the current unfinished event (at most `MAX_EVENT` bytes; a longer
one is skipped, not buffered); for a JSON body, at most `MAX_JSON` bytes. Each JSON document seen
(the body, or each event's `data`) may carry `model` and `usage` at its top, under `message`
(Anthropic's `message_start`) or under `response` (OpenAI's Responses API events); the last value
seen for each field wins, as Anthropic's `message_delta` and OpenAI's final chunk report totals.

Field names: `input_tokens`/`prompt_tokens`, `output_tokens`/`completion_tokens`,
`cache_read_input_tokens`/`prompt_tokens_details.cached_tokens`/`input_tokens_details.cached_tokens`
and `cache_creation_input_tokens`. A value that is not a non-negative integer up to `MAX_TOKENS`
makes the usage not believed (`invalid`, naming the field): it is recorded as such, never summed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from umbra.contracts.traffic import MAX_MODEL, MAX_TOKENS

MAX_EVENT = 256 << 10
MAX_JSON = 4 << 20

# (record field, where it may be in a usage object)
_FIELDS: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    ("llm_input_tokens", (("input_tokens",), ("prompt_tokens",))),
    ("llm_output_tokens", (("output_tokens",), ("completion_tokens",))),
    (
        "llm_cache_read_tokens",
        (
            ("cache_read_input_tokens",),
            ("prompt_tokens_details", "cached_tokens"),
            ("input_tokens_details", "cached_tokens"),
        ),
    ),
    ("llm_cache_write_tokens", (("cache_creation_input_tokens",),)),
)
_ABSENT = object()


def provider_of(path: str) -> str | None:
    """Which API shape a request path has (`anthropic`, `openai`), or None."""
    path = path.partition("?")[0].rstrip("/")
    if path.endswith("/v1/messages"):
        return "anthropic"
    if path.endswith(("/chat/completions", "/v1/completions", "/v1/responses")):
        return "openai"
    return None


def _dig(value: object, keys: tuple[str, ...]) -> object:
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return _ABSENT
        value = value[key]
    return value


@dataclass
class UsageReader:
    event_stream: bool
    model: str | None = None
    tokens: dict[str, int] = field(default_factory=dict)
    invalid: str | None = None
    _pending: bytearray = field(default_factory=bytearray)
    _skipping: bool = False
    _size: int = 0

    def feed(self, chunk: bytes) -> None:
        if self.event_stream:
            self._feed_events(chunk)
        elif self._size < MAX_JSON:
            self._pending += chunk[: MAX_JSON - self._size]
            self._size += len(chunk)

    def finish(self) -> None:
        if self.event_stream:
            self._feed_events(b"\n\n")
        elif self._size <= MAX_JSON and self._pending:
            self._document(bytes(self._pending))
        self._pending.clear()

    def _feed_events(self, chunk: bytes) -> None:
        # CR never occurs raw inside JSON: dropping it makes every line end a LF, across chunks too
        data = chunk.replace(b"\r", b"")
        if data.startswith(b"\n") and self._pending.endswith(b"\n"):
            data = b"\n" + data  # the blank line that ends an event, split between chunks
            self._pending = self._pending[:-1]
        while data:
            end = data.find(b"\n\n")
            piece, data = (data, b"") if end < 0 else (data[:end], data[end + 2 :])
            if not self._skipping:
                if len(self._pending) + len(piece) > MAX_EVENT:
                    self._skipping = True  # an event too long to be usage: not kept
                    self._pending.clear()
                else:
                    self._pending += piece
            if end < 0:
                return
            if not self._skipping:
                self._event(bytes(self._pending))
            self._pending.clear()
            self._skipping = False

    def _event(self, event: bytes) -> None:
        lines = [
            line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        ]
        if lines:
            payload = b"\n".join(lines)
            # most events are content deltas: only one naming usage or a model is parsed
            if b'"usage"' in payload or b'"model"' in payload:
                self._document(payload)

    def _document(self, payload: bytes) -> None:
        try:
            document = json.loads(payload)
        except (ValueError, RecursionError):
            return
        if not isinstance(document, dict):
            return
        for holder in (document, document.get("message"), document.get("response")):
            if isinstance(holder, dict):
                self._read(holder)

    def _read(self, holder: dict[str, object]) -> None:
        model = holder.get("model")
        if isinstance(model, str) and model:
            self.model = model[:MAX_MODEL]
        usage = holder.get("usage")
        if not isinstance(usage, dict):
            return
        for name, paths in _FIELDS:
            for path in paths:
                value = _dig(usage, path)
                if value is _ABSENT or value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, int):
                    self.invalid = f"usage {'.'.join(path)} is not an integer"
                elif not 0 <= value <= MAX_TOKENS:
                    self.invalid = f"usage {'.'.join(path)} is out of range (0 to {MAX_TOKENS})"
                else:
                    self.tokens[name] = value
                break

    def record_fields(self) -> dict[str, object]:
        """The record's usage fields; empty when none was read or it was not believed."""
        if self.invalid is not None or not (self.tokens or self.model):
            return {}
        return {"llm_model": self.model, **self.tokens}
