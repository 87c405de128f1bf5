"""The stand-in model API on its own: the event sequences the real APIs send, the key check, and
that nothing a client sent comes back."""

from __future__ import annotations

import hashlib
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.proxy.harness import TestCA as OriginCA
from umbra.cli.llm_origin import REPLY, Api, OriginConfig, OriginServer, serve

KEY_A = "sk-ant-test-origin-key-000111222333"
KEY_O = "sk-openai-test-origin-key-444555666"


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[OriginServer, Path]]:
    workdir = tmp_path_factory.mktemp("llm")
    ca = OriginCA(workdir)
    cert, key = ca.issue(["llm.test"])
    config = OriginConfig(
        {
            Api.ANTHROPIC: hashlib.sha256(KEY_A.encode()).hexdigest(),
            Api.OPENAI: hashlib.sha256(KEY_O.encode()).hexdigest(),
        }
    )
    server = serve(config, str(cert), str(key))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, ca.cert_path
    server.shutdown()


def _client(origin: tuple[OriginServer, Path]) -> httpx.Client:
    server, ca = origin
    return httpx.Client(
        base_url=f"https://127.0.0.1:{server.port}", verify=ssl.create_default_context(cafile=ca)
    )


def _events(text: str) -> list[tuple[str | None, str]]:
    out = []
    for block in text.strip().split("\n\n"):
        name, data = None, ""
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        out.append((name, data))
    return out


def test_anthropic_messages_stream_in_the_api_order(origin: tuple[OriginServer, Path]) -> None:
    with _client(origin) as client:
        answer = client.post(
            "/v1/messages",
            headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01"},
            json={"model": "m", "max_tokens": 10, "stream": True, "messages": []},
        )
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "text/event-stream"
    events = _events(answer.text)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    text = "".join(json.loads(data)["delta"]["text"] for name, data in events[3:-3])
    assert text == REPLY
    delta = json.loads(events[-2][1])
    assert delta["delta"]["stop_reason"] == "end_turn" and delta["usage"]["output_tokens"] > 0


def test_anthropic_messages_json(origin: tuple[OriginServer, Path]) -> None:
    with _client(origin) as client:
        answer = client.post("/v1/messages", headers={"x-api-key": KEY_A}, json={"model": "m"})
    document = answer.json()
    assert document["type"] == "message" and document["content"][0]["text"] == REPLY


def test_openai_responses_stream_in_the_api_order(origin: tuple[OriginServer, Path]) -> None:
    with _client(origin) as client:
        answer = client.post(
            "/v1/responses",
            headers={"authorization": f"Bearer {KEY_O}"},
            json={"model": "m", "stream": True, "input": "hi"},
        )
    events = _events(answer.text)
    names = [name for name, _ in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    datas = [json.loads(data) for _, data in events]
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    assert "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta") == REPLY
    completed = datas[-1]["response"]
    assert completed["status"] == "completed" and completed["usage"]["total_tokens"] > 0


def test_openai_chat_completions_stream_ends_with_done(origin: tuple[OriginServer, Path]) -> None:
    with _client(origin) as client:
        answer = client.post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY_O}"},
            json={"model": "m", "stream": True, "messages": []},
        )
    events = _events(answer.text)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == REPLY


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/v1/messages", {"x-api-key": "umbra-placeholder:team/anthropic-api-key"}),
        ("/v1/messages", {"x-api-key": KEY_O}),
        ("/v1/messages", {}),
        ("/v1/responses", {"authorization": "Bearer umbra-placeholder:personal/openai-api-key"}),
        ("/v1/responses", {"authorization": f"Bearer {KEY_A}"}),
    ],
)
def test_a_wrong_key_is_refused_and_never_echoed(
    origin: tuple[OriginServer, Path], path: str, headers: dict[str, str]
) -> None:
    with _client(origin) as client:
        answer = client.post(path, headers=headers, json={"stream": True})
    assert answer.status_code == 401
    for value in headers.values():
        assert value.removeprefix("Bearer ") not in answer.text
    assert "did not receive the real API key" in answer.text
    server, _ = origin
    assert not server.config.seen[-1].key_ok
