"""LLM usage accounting through the real proxy: Anthropic- and OpenAI-shaped origins answering
with JSON and with event streams; the usage they report lands in the exchange's record, a stream
stays a stream (the first event reaches the client while the origin still holds the last), and
usage that lies is recorded as `usage_invalid`, never summed, never a crash."""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.proxy.harness import (
    OriginHandler,
    OriginServer,
    ProxyProcess,
    Recorder,
    Seen,
    TestCA,
    auth_header,
    curl,
    curl_status,
    start_proxy,
    write_identities,
)

HOSTS = ["anthropic.test", "openai.test", "metered.test"]
RELEASE = threading.Event()


def sse(events: list[tuple[str | None, object]]) -> list[bytes]:
    out = []
    for name, data in events:
        head = f"event: {name}\r\n" if name else ""
        body = data if isinstance(data, str) else json.dumps(data)
        out.append(f"{head}data: {body}\r\n\r\n".encode())
    return out


ANTHROPIC_STREAM = sse(
    [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "model": "claude-sonnet-4-5", "usage": {
                "input_tokens": 1200, "output_tokens": 1,
                "cache_read_input_tokens": 800, "cache_creation_input_tokens": 40}}}),
        ("content_block_delta", {"type": "content_block_delta", "delta": {"text": "Hel"}}),
        ("content_block_delta", {"type": "content_block_delta", "delta": {"text": "lo"}}),
        ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 321}}),
        ("message_stop", {"type": "message_stop"}),
    ]
)  # fmt: skip
OPENAI_STREAM = sse(
    [
        (None, {"object": "chat.completion.chunk", "model": "gpt-5", "choices": [{"delta": {"content": "Hi"}}]}),
        (None, {"object": "chat.completion.chunk", "model": "gpt-5", "choices": [], "usage": {
            "prompt_tokens": 90, "completion_tokens": 12, "prompt_tokens_details": {"cached_tokens": 64}}}),
        (None, "[DONE]"),
    ]
)  # fmt: skip


def _llm(handler: OriginHandler, seen: Seen) -> None:
    path = seen.path
    json_type = {"content-type": "application/json"}
    if path == "/v1/messages" and b'"stream": true' in seen.body:
        # the last event waits until the client has read the others through the proxy
        _held_stream(handler, ANTHROPIC_STREAM)
    elif path == "/v1/messages":
        body = {
            "model": "claude-haiku-4-5",
            "content": [],
            "usage": {"input_tokens": 10, "output_tokens": 5},
        }
        handler.send(200, json.dumps(body).encode(), json_type)
    elif path == "/v1/chat/completions":
        handler.chunked(OPENAI_STREAM, 0.0, {"content-type": "text/event-stream"})
    elif path == "/v1/responses":
        body = {
            "model": "gpt-5-mini",
            "usage": {
                "input_tokens": 7,
                "output_tokens": 3,
                "input_tokens_details": {"cached_tokens": 2},
            },
        }
        handler.send(200, json.dumps(body).encode(), json_type)
    elif path == "/lying/v1/messages":
        body = {"model": "claude", "usage": {"input_tokens": -5, "output_tokens": 10**30}}
        handler.send(200, json.dumps(body).encode(), json_type)
    elif path == "/strings/v1/chat/completions":
        body = {"model": "gpt", "usage": {"prompt_tokens": "lots", "completion_tokens": True}}
        handler.send(200, json.dumps(body).encode(), json_type)
    elif path == "/garbage/v1/messages":
        handler.chunked(
            [b"data: {not json\n\n", b"data: [1, 2\n\n", b": comment\n\n"],
            0.0,
            {"content-type": "text/event-stream"},
        )
    else:
        handler.send(200, b'{"model": "x"}', json_type)


def _held_stream(handler: OriginHandler, events: list[bytes]) -> None:
    handler.send_response(200)
    handler.send_header("content-type", "text/event-stream")
    handler.send_header("transfer-encoding", "chunked")
    handler.end_headers()
    for index, event in enumerate(events):
        if index == len(events) - 1:
            RELEASE.wait(20)
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        handler.wfile.flush()
    handler.wfile.write(b"0\r\n\r\n")
    handler.wfile.flush()


@dataclass
class UsageEnv:
    origin: OriginServer
    proxy: ProxyProcess

    def url(self, host: str, path: str) -> str:
        return f"https://{host}:{self.origin.port}{path}"


@pytest.fixture(scope="module")
def uenv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UsageEnv]:
    workdir = tmp_path_factory.mktemp("usage")
    ca = TestCA(workdir)
    cert, key = ca.issue(HOSTS)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    origin = OriginServer(Recorder(), tls).start()
    for host in HOSTS:
        origin.routes[host] = _llm
    policy_dir = workdir / "policies"
    policy_dir.mkdir()
    (policy_dir / "testing.yaml").write_text(
        "apiVersion: umbra/v1\nkind: Profile\nname: testing\negress:\n"
        f"  - {{id: llm, allow: {{hosts: [{', '.join(HOSTS)}], ports: [{origin.port}]}}}}\n"
        "budgets:\n"
        "  - {id: monthly, per: owner, hosts: [metered.test], tokens_per_month: 20}\n"
    )
    resolver = workdir / "resolver.json"
    resolver.write_text(json.dumps({name: ["127.0.0.1"] for name in HOSTS}))
    identities = workdir / "identities.json"
    write_identities(identities)
    secrets = workdir / "secrets.json"
    secrets.write_text(json.dumps({"team": {}}))
    secrets.chmod(0o600)
    proxy = start_proxy(
        [
            *("--policy-dir", str(policy_dir), "--identities", str(identities)),
            *("--secrets", str(secrets), "--upstream-ca", str(ca.cert_path)),
            *("--test-allow-upstream", "127.0.0.1/32", "--test-resolver", str(resolver)),
        ],
        workdir,
    )
    yield UsageEnv(origin, proxy)
    output = proxy.stop()
    origin.shutdown()
    assert "failing closed" not in output and "usage reading failed" not in output


def post(uenv: UsageEnv, host: str, path: str, body: dict[str, Any]) -> Any:
    return curl(
        uenv.proxy,
        uenv.url(host, path),
        *("-H", "content-type: application/json", "-H", "accept-encoding: gzip, br"),
        *("--compressed", "--data-binary", json.dumps(body)),
    )


def record_for(uenv: UsageEnv, mark: int, path: str) -> dict[str, Any]:
    return uenv.proxy.log.wait_for(
        mark, lambda r: r.get("path") == path and r["reason"] == "rule_allow"
    )


def test_anthropic_json_usage_is_recorded(uenv: UsageEnv) -> None:
    mark = uenv.proxy.log.mark()
    assert curl_status(post(uenv, "anthropic.test", "/v1/messages", {"stream": False})) == 200
    record = record_for(uenv, mark, "/v1/messages")
    assert record["llm_model"] == "claude-haiku-4-5"
    assert (record["llm_input_tokens"], record["llm_output_tokens"]) == (10, 5)
    assert record["llm_cache_read_tokens"] is None


def test_anthropic_stream_stays_a_stream_and_its_usage_is_recorded(uenv: UsageEnv) -> None:
    RELEASE.clear()
    mark = uenv.proxy.log.mark()
    context = ssl.create_default_context(cafile=str(uenv.proxy.ca))
    sock = socket.create_connection(("127.0.0.1", uenv.proxy.port), timeout=20)
    target = f"anthropic.test:{uenv.origin.port}"
    sock.sendall(
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: {auth_header()}"
        "\r\n\r\n".encode()
    )
    assert b" 200 " in sock.recv(4096)
    tls = context.wrap_socket(sock, server_hostname="anthropic.test")
    body = b'{"stream": true}'
    tls.sendall(
        f"POST /v1/messages HTTP/1.1\r\nHost: {target}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    received = b""
    while b"message_delta" not in received:
        chunk = tls.recv(65536)
        assert chunk, "stream ended early"
        received += chunk
    # everything but the last event arrived while the origin still holds that event back
    assert b"message_stop" not in received
    RELEASE.set()
    while b"0\r\n\r\n" not in received:
        chunk = tls.recv(65536)
        if not chunk:
            break
        received += chunk
    tls.close()
    assert b"message_stop" in received
    record = record_for(uenv, mark, "/v1/messages")
    assert record["llm_model"] == "claude-sonnet-4-5"
    assert record["llm_input_tokens"] == 1200 and record["llm_output_tokens"] == 321
    assert (record["llm_cache_read_tokens"], record["llm_cache_write_tokens"]) == (800, 40)


def test_openai_stream_and_responses_usage_are_recorded(uenv: UsageEnv) -> None:
    mark = uenv.proxy.log.mark()
    result = post(uenv, "openai.test", "/v1/chat/completions", {"stream": True})
    assert curl_status(result) == 200 and "[DONE]" in result.stdout
    record = record_for(uenv, mark, "/v1/chat/completions")
    assert record["llm_model"] == "gpt-5"
    assert (record["llm_input_tokens"], record["llm_output_tokens"]) == (90, 12)
    assert record["llm_cache_read_tokens"] == 64
    assert curl_status(post(uenv, "openai.test", "/v1/responses", {})) == 200
    record = record_for(uenv, mark, "/v1/responses")
    assert (record["llm_model"], record["llm_input_tokens"], record["llm_cache_read_tokens"]) == (
        "gpt-5-mini", 7, 2,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("host", "path", "fragment"),
    [
        ("anthropic.test", "/lying/v1/messages", "out of range"),
        ("openai.test", "/strings/v1/chat/completions", "not an integer"),
    ],
)
def test_usage_that_lies_is_recorded_with_its_own_reason(
    uenv: UsageEnv, host: str, path: str, fragment: str
) -> None:
    mark = uenv.proxy.log.mark()
    assert curl_status(post(uenv, host, path, {})) == 200  # the answer still goes through
    side = uenv.proxy.log.wait_for(mark, lambda r: r["reason"] == "usage_invalid")
    assert side["path"] == path and fragment in side["detail"]
    record = record_for(uenv, mark, path)
    assert record["llm_input_tokens"] is None and record["llm_model"] is None


def test_garbage_events_are_ignored(uenv: UsageEnv) -> None:
    mark = uenv.proxy.log.mark()
    assert curl_status(post(uenv, "anthropic.test", "/garbage/v1/messages", {})) == 200
    record = record_for(uenv, mark, "/garbage/v1/messages")
    assert record["llm_model"] is None


def test_a_monthly_token_budget_per_developer_refuses_further_calls(uenv: UsageEnv) -> None:
    # each call reports 10 + 5 tokens: the second crosses 20 and completes, the third is refused
    statuses = [curl_status(post(uenv, "metered.test", "/v1/messages", {})) for _ in range(2)]
    mark = uenv.proxy.log.mark()
    refused = post(uenv, "metered.test", "/v1/messages", {})
    assert statuses == [200, 200] and curl_status(refused) == 429
    assert "budget testing:monthly: 20 tokens a month per owner reached" in refused.stdout
    record = uenv.proxy.log.wait_for(mark, lambda r: r["reason"] == "budget_exceeded")
    assert record["rule_id"] == "testing:monthly"
