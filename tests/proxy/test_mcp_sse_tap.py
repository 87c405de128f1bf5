"""The HTTP+SSE event tap on its own: events split anywhere across chunks, any line ending; a
refusal's stand-in answer replaced by its errors; everything else byte for byte; an event past
the bound passed on, never held whole."""

from __future__ import annotations

import json

from umbra.proxy.mcp_sse import MAX_EVENT_BYTES, EventTap, SseEndpoints, SseEvent, stand_in

BASE = "https://mcp.test:443/sse"


def feed(tap: EventTap, data: bytes, size: int) -> bytes:
    out = b"".join(tap(data[i : i + size]) for i in range(0, len(data), size))
    return out + tap(b"")


def test_events_pass_unchanged_and_the_endpoint_is_announced() -> None:
    seen: list[SseEvent] = []
    endpoints = SseEndpoints()
    tap = EventTap(endpoints, "cvm", BASE, seen.append)
    stream = b'event: endpoint\ndata: /messages/?session_id=ab\n\n: ping\r\n\r\ndata: {"a": 1}\r\r'
    assert feed(tap, stream, 3) == stream
    # announced while the stream lasted, forgotten at its end
    assert endpoints.stream_for(("cvm", "mcp.test", 443, "/messages/?session_id=ab")) is None
    assert [e.data for e in seen][-1] == b'{"a": 1}'


def test_the_stand_in_answer_becomes_the_refusal() -> None:
    endpoints = SseEndpoints()
    tap = EventTap(endpoints, "cvm", BASE, lambda event: None)
    head = b"event: endpoint\r\ndata: /messages/?session_id=ab\r\n\r\n"
    assert tap(head) == head
    stream = endpoints.stream_for(("cvm", "mcp.test", 443, "/messages/?session_id=ab"))
    assert stream is not None
    errors: list[dict[str, object]] = [{"jsonrpc": "2.0", "id": 7, "error": {"code": -32001}}]
    ping = json.loads(stand_in(stream, errors) or b"")
    other = b'event: message\r\ndata: {"jsonrpc": "2.0", "id": 3, "result": {}}\r\n\r\n'
    answer = (
        f'event: message\r\ndata: {{"jsonrpc":"2.0","id":"{ping["id"]}","result":{{}}}}\r\n\r\n'
    )
    out = feed(tap, other + answer.encode(), 5)
    assert out.startswith(other)
    assert json.loads(out[len(other) :].split(b"data: ")[1]) == errors[0]
    assert not stream.pending


def test_an_endless_event_is_passed_on_while_a_refusal_waits() -> None:
    endpoints = SseEndpoints()
    tap = EventTap(endpoints, "cvm", BASE, lambda event: None)
    tap(b"event: endpoint\ndata: /m\n\n")
    stream = endpoints.stream_for(("cvm", "mcp.test", 443, "/m"))
    assert stream is not None and stand_in(stream, []) is not None
    sent = sum(len(tap(b"x" * 65536)) for _ in range(64))
    assert sent >= 64 * 65536 - MAX_EVENT_BYTES - 65536
