"""MCP tool rules on the legacy HTTP+SSE transport, through the real proxy: a real MCP client
(`mcp.client.sse`) and server (`MCPServer.sse_app` under uvicorn, TLS). The client GETs the event
stream, which names the POST endpoint; a refused `tools/call` POSTed there is answered on the
event stream as a JSON-RPC error the agent reads, the session goes on; tool lists arriving on the
stream are compared; malformed bodies are refused on the POST; a server that streams forever,
with a refusal waiting, stalls nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import httpx2
import pytest
from mcp import ClientSession
from mcp.client.sse import sse_client
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError

from tests.proxy.harness import ProxyProcess, TestCA, start_proxy, write_identities
from tests.proxy.mcp_origin import McpOrigin, build_server, proxied_client

HOSTS = ["sse.test", "forever.test"]
FOREVER_SID = "f0f0"


def policy(port: int, forever_port: int) -> str:
    return f"""
apiVersion: umbra/v1
kind: Profile
name: testing
egress:
  - id: sse-tools
    allow: {{hosts: [sse.test, forever.test], ports: [{port}, {forever_port}], paths: [/sse, /messages/]}}
    mcp:
      tools:
        - {{name: echo}}
        - name: create_issue
          arguments: [{{pointer: /repo, pattern: "acme/[a-z-]+"}}]
"""


async def forever_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An HTTP+SSE server that announces its endpoint, accepts every POST (202) and never
    answers it, then streams one event that never ends."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["method"] == "POST":
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 202, "headers": []})
        await send({"type": "http.response.body", "body": b"Accepted"})
        return
    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    endpoint = f"event: endpoint\r\ndata: /messages/?session_id={FOREVER_SID}\r\n\r\n"
    await send({"type": "http.response.body", "body": endpoint.encode(), "more_body": True})
    await asyncio.sleep(0.5)  # the test POSTs a refused call meanwhile
    await send({"type": "http.response.body", "body": b"data: ", "more_body": True})
    chunk = b"x" * 65536
    with contextlib.suppress(Exception):
        while True:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(0)


@dataclass
class SseEnv:
    sse: McpOrigin
    forever: McpOrigin
    proxy: ProxyProcess

    @property
    def url(self) -> str:
        return f"https://sse.test:{self.sse.port}/sse"


@pytest.fixture(scope="module")
def senv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SseEnv]:
    workdir = tmp_path_factory.mktemp("mcp-sse")
    ca = TestCA(workdir)
    cert, key = ca.issue(HOSTS)
    server = build_server()
    app = server.sse_app(
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False)
    )
    sse = McpOrigin(server, cert, key, app).start()
    forever = McpOrigin(build_server(), cert, key, forever_app).start()
    policy_dir = workdir / "policies"
    policy_dir.mkdir()
    (policy_dir / "testing.yaml").write_text(policy(sse.port, forever.port))
    resolver = workdir / "resolver.json"
    resolver.write_text(json.dumps({name: ["127.0.0.1"] for name in HOSTS}))
    write_identities(workdir / "identities.json")
    (workdir / "secrets.json").write_text(json.dumps({"team": {}}))
    (workdir / "secrets.json").chmod(0o600)
    args = [
        *("--policy-dir", str(policy_dir), "--identities", str(workdir / "identities.json")),
        *("--secrets", str(workdir / "secrets.json"), "--upstream-ca", str(ca.cert_path)),
        *("--test-allow-upstream", "127.0.0.1/32", "--test-resolver", str(resolver)),
    ]
    proxy = start_proxy(args, workdir)
    yield SseEnv(sse, forever, proxy)
    output = proxy.stop()
    sse.stop()
    forever.stop()
    assert "failing closed" not in output and "Traceback" not in output


def run[T](coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 60))


@contextlib.asynccontextmanager
async def sse_session(
    senv: SseEnv, sessions: list[str] | None = None
) -> AsyncIterator[ClientSession]:
    def factory(
        headers: dict[str, str] | None = None,
        timeout: httpx2.Timeout | None = None,
        auth: httpx2.Auth | None = None,
    ) -> httpx2.AsyncClient:
        client = proxied_client(senv.proxy)
        client.headers.update(headers or {})
        return client

    async with (
        sse_client(
            senv.url,
            httpx_client_factory=factory,
            on_session_created=(sessions.append if sessions is not None else None),
        ) as (read, write),
        ClientSession(read, write) as mcp,
    ):
        await asyncio.wait_for(mcp.initialize(), 20)
        yield mcp


def test_a_refused_call_is_answered_on_the_event_stream(senv: SseEnv) -> None:
    async def scenario() -> dict[str, Any]:
        async with sse_session(senv) as mcp:
            tools = await mcp.list_tools()
            echoed = await mcp.call_tool("echo", {"text": "hello"})
            errors = {}
            for name, arguments in (
                ("delete_repo", {"repo": "acme/widgets"}),
                ("create_issue", {"repo": "evil/x", "title": "t"}),
            ):
                try:
                    await asyncio.wait_for(mcp.call_tool(name, arguments), 10)
                except MCPError as exc:
                    errors[name] = str(exc)
            after = await mcp.call_tool("echo", {"text": "still here"})
            return {
                "tools": sorted(tool.name for tool in tools.tools),
                "echo": echoed.content[0].text,  # type: ignore[union-attr]
                "errors": errors,
                "after": after.content[0].text,  # type: ignore[union-attr]
            }

    mark = senv.proxy.log.mark()
    outcome = run(scenario())
    assert outcome["tools"] == ["create_issue", "delete_repo", "echo"]
    assert outcome["echo"] == "echo: hello" and outcome["after"] == "echo: still here"
    assert (
        "umbra: denied (mcp_tool_denied): tool delete_repo is not allowed"
        in outcome["errors"]["delete_repo"]
    )
    assert "argument /repo does not match" in outcome["errors"]["create_issue"]
    record = senv.proxy.log.wait_for(
        mark, lambda r: r["reason"] == "mcp_tool_denied" and "delete_repo" in r.get("detail", "")
    )
    assert record["decision"] == "deny" and record["rule_id"] == "testing:sse-tools"
    assert record["status"] == 202 and record["path"] == "/messages/"


def test_a_tool_list_on_the_event_stream_that_changes_is_recorded(senv: SseEnv) -> None:
    async def list_tools() -> list[str]:
        async with sse_session(senv) as mcp:
            return sorted(tool.name for tool in (await mcp.list_tools()).tools)

    run(list_tools())  # approved (if the test above did not already)

    def exfiltrate(data: str) -> str:
        """Send data somewhere."""
        return "sent"

    senv.sse.server.add_tool(exfiltrate)
    mark = senv.proxy.log.mark()
    try:
        names = run(list_tools())
    finally:
        senv.sse.server.remove_tool("exfiltrate")
    assert "exfiltrate" in names
    record = senv.proxy.log.wait_for(mark, lambda r: r["reason"] == "mcp_tools_changed")
    assert "added exfiltrate" in record["detail"] and record["path"] == "/sse"


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        (b"{truncated", 400, "body_unreadable"),
        (b'{"jsonrpc": "1.0", "id": 1, "method": "tools/list"}', 400, "mcp_malformed"),
        # a batch: the endpoint's query (session_id) beside a non-object body is unreadable
        (b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]', 400, "body_unreadable"),
        (b'{"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "delete_repo"}}', 403, "mcp_tool_denied"),
    ],
)  # fmt: skip
def test_malformed_posts_to_the_endpoint_are_refused_and_the_session_goes_on(
    senv: SseEnv, body: bytes, status: int, reason: str
) -> None:
    async def scenario() -> tuple[int, str]:
        sessions: list[str] = []
        async with sse_session(senv, sessions) as mcp:
            endpoint = f"https://sse.test:{senv.sse.port}/messages/?session_id={sessions[0]}"
            async with proxied_client(senv.proxy) as client:
                response = await client.post(
                    endpoint, content=body, headers={"content-type": "application/json"}
                )
            after = await mcp.call_tool("echo", {"text": "on"})
            return response.status_code, after.content[0].text  # type: ignore[union-attr]

    mark = senv.proxy.log.mark()
    code, after = run(scenario())
    assert (code, after) == (status, "echo: on")
    senv.proxy.log.wait_for(mark, lambda r: r["reason"] == reason)


def test_a_server_streaming_forever_with_a_refusal_waiting_stalls_nothing(senv: SseEnv) -> None:
    """The refusal's stand-in is never answered and the stream's one event never ends: the
    client still gets the stream (the tap holds at most 1 MiB of an event), and the proxy goes on."""
    base = f"https://forever.test:{senv.forever.port}"

    async def scenario() -> tuple[int, int]:
        async with (
            proxied_client(senv.proxy) as client,
            client.stream("GET", f"{base}/sse") as stream,
        ):
            received = 0
            posted = 0
            async for chunk in stream.aiter_bytes():
                received += len(chunk)
                if not posted and b"endpoint" in chunk:
                    refused = {
                        "jsonrpc": "2.0", "id": 5, "method": "tools/call",
                        "params": {"name": "delete_repo", "arguments": {}},
                    }  # fmt: skip
                    async with proxied_client(senv.proxy) as poster:
                        answer = await poster.post(
                            f"{base}/messages/?session_id={FOREVER_SID}", json=refused
                        )
                    posted = answer.status_code
                if received > 8 << 20:
                    break
            return posted, received

    mark = senv.proxy.log.mark()
    posted, received = run(scenario())
    assert posted == 202 and received > 8 << 20
    senv.proxy.log.wait_for(
        mark, lambda r: r["reason"] == "mcp_tool_denied" and r["host"].startswith("forever.test")
    )
    # the proxy still serves
    assert run(_echo(senv)) == "echo: alive"


async def _echo(senv: SseEnv) -> str:
    async with sse_session(senv) as mcp:
        return (await mcp.call_tool("echo", {"text": "alive"})).content[0].text  # type: ignore[union-attr]
