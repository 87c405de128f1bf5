"""Request-field rules and MCP tool rules through the real proxy: a Slack-shaped origin that may
get `chat.postMessage` only for channels C1 and C2, and a real MCP server (the `mcp` package,
streamable HTTP) called by a real MCP client session, allowed two tools of three."""

from __future__ import annotations

import asyncio
import gzip
import json
import ssl
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import httpx2
import pytest
from mcp.shared.exceptions import MCPError

from tests.proxy.harness import (
    OriginHandler,
    OriginServer,
    ProxyProcess,
    Recorder,
    Seen,
    TestCA,
    curl,
    curl_status,
    start_proxy,
    write_identities,
)
from tests.proxy.mcp_origin import McpOrigin, build_server, proxied_client, session

HOSTS = ["slack.test", "mcp.test"]


def policy(slack_port: int, mcp_port: int) -> str:
    return f"""
apiVersion: umbra/v1
kind: Profile
name: testing
egress:
  - id: slack-post
    allow: {{hosts: [slack.test], ports: [{slack_port}], methods: [POST], paths: [/api/chat.postMessage]}}
    body:
      - {{pointer: /channel, one_of: [C1, C2]}}
      - {{pointer: /as_user, absent: true}}
  - id: tools
    allow: {{hosts: [mcp.test], ports: [{mcp_port}], paths: [/mcp]}}
    mcp:
      tools:
        - {{name: echo}}
        - name: create_issue
          arguments: [{{pointer: /repo, pattern: "acme/[a-z-]+"}}]
"""


@dataclass
class FieldsEnv:
    recorder: Recorder
    slack: OriginServer
    mcp: McpOrigin
    proxy: ProxyProcess
    args: list[str]

    def slack_url(self, query: str = "") -> str:
        return f"https://slack.test:{self.slack.port}/api/chat.postMessage{query}"

    @property
    def mcp_url(self) -> str:
        return f"https://mcp.test:{self.mcp.port}/mcp"


def _slack(handler: OriginHandler, seen: Seen) -> None:
    handler.send(200, b'{"ok": true}', {"content-type": "application/json"})


@pytest.fixture(scope="module")
def fenv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FieldsEnv]:
    workdir = tmp_path_factory.mktemp("fields")
    ca = TestCA(workdir)
    cert, key = ca.issue(HOSTS)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    recorder = Recorder()
    slack = OriginServer(recorder, tls).start()
    slack.routes["slack.test"] = _slack
    mcp = McpOrigin(build_server(), cert, key).start()
    policy_dir = workdir / "policies"
    policy_dir.mkdir()
    (policy_dir / "testing.yaml").write_text(policy(slack.port, mcp.port))
    resolver = workdir / "resolver.json"
    resolver.write_text(json.dumps({name: ["127.0.0.1"] for name in HOSTS}))
    identities = workdir / "identities.json"
    write_identities(identities)
    secrets = workdir / "secrets.json"
    secrets.write_text(json.dumps({"team": {}}))
    secrets.chmod(0o600)
    args = [
        *("--policy-dir", str(policy_dir), "--identities", str(identities)),
        *("--secrets", str(secrets), "--upstream-ca", str(ca.cert_path)),
        *("--test-allow-upstream", "127.0.0.1/32", "--test-resolver", str(resolver)),
    ]
    proxy = start_proxy(args, workdir)
    yield FieldsEnv(recorder, slack, mcp, proxy, args)
    output = proxy.stop()
    slack.shutdown()
    mcp.stop()
    # no hook failed closed (mitmproxy's own shutdown of open event streams may log)
    assert "failing closed" not in output


def _post(fenv: FieldsEnv, body: bytes, content_type: str, extra: list[str], query: str) -> Any:
    path = fenv.proxy.output.parent / "body.bin"
    path.write_bytes(body)
    return curl(
        fenv.proxy,
        fenv.slack_url(query),
        *("-X", "POST", "-H", f"content-type: {content_type}"),
        *("--data-binary", f"@{path}", *extra),
    )


def slack_seen(fenv: FieldsEnv) -> list[bytes]:
    return [s.body for s in fenv.recorder.snapshot() if s.host.startswith("slack.test")]


def test_slack_messages_only_to_the_listed_channels(fenv: FieldsEnv) -> None:
    mark = fenv.proxy.log.mark()
    ok = _post(fenv, b'{"channel": "C1", "text": "build green"}', "application/json", [], "")
    assert curl_status(ok) == 200 and '"ok": true' in ok.stdout
    record = fenv.proxy.log.wait_for(mark, lambda r: r.get("host", "").startswith("slack.test"))
    assert record["decision"] == "allow" and record["rule_id"] == "testing:slack-post"
    form = _post(fenv, b"channel=C2&text=hi", "application/x-www-form-urlencoded", [], "")
    assert curl_status(form) == 200
    before = len(slack_seen(fenv))
    mark = fenv.proxy.log.mark()
    refused = _post(fenv, b'{"channel": "C3", "text": "exfil"}', "application/json", [], "")
    assert curl_status(refused) == 403
    assert "body_field_denied" in refused.stdout and "/channel is not one of" in refused.stdout
    record = fenv.proxy.log.wait_for(mark, lambda r: r["reason"] == "body_field_denied")
    assert record["decision"] == "deny" and record["rule_id"] == "testing:slack-post"
    assert "exfil" not in json.dumps(record)
    assert len(slack_seen(fenv)) == before  # nothing was forwarded


@pytest.mark.parametrize(
    ("body", "content_type", "extra", "query", "status", "reason"),
    [
        (b'{"channel": "C1", "channel": "C3"}', "application/json", [], "", 400, "body_unreadable"),
        (b"{not json", "application/json", [], "", 400, "body_unreadable"),
        (b'{"channel": "C1"}', "text/plain", [], "", 400, "body_unreadable"),
        (b"channel=C1", "application/x-www-form-urlencoded", [], "?channel=C3", 400, "body_unreadable"),
        (b"channel=C1&as_user=true", "application/x-www-form-urlencoded", [], "", 403, "body_field_denied"),
        (b"[" * 64 + b"]" * 64, "application/json", [], "", 413, "body_limit"),
        (gzip.compress(b'{"channel": "C3"}'), "application/json", ["-H", "content-encoding: gzip"], "", 403, "body_field_denied"),
        (b"\x1f\x8b broken", "application/json", ["-H", "content-encoding: gzip"], "", 400, "body_unreadable"),
    ],
)  # fmt: skip
def test_bodies_the_rule_cannot_vouch_for_are_refused(
    fenv: FieldsEnv,
    body: bytes,
    content_type: str,
    extra: list[str],
    query: str,
    status: int,
    reason: str,
) -> None:
    before = len(slack_seen(fenv))
    mark = fenv.proxy.log.mark()
    result = _post(fenv, body, content_type, extra, query)
    assert curl_status(result) == status, result.stdout
    fenv.proxy.log.wait_for(mark, lambda r: r["reason"] == reason)
    assert len(slack_seen(fenv)) == before


def test_a_gzip_body_for_an_allowed_channel_passes(fenv: FieldsEnv) -> None:
    packed = gzip.compress(b'{"channel": "C2", "text": "zipped"}')
    result = _post(fenv, packed, "application/json", ["-H", "content-encoding: gzip"], "")
    assert curl_status(result) == 200


# ------------------------------------------------------------------ MCP


def run[T](coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_real_mcp_client_calls_the_allowed_tools_and_reads_the_refusal(fenv: FieldsEnv) -> None:
    async def scenario() -> dict[str, Any]:
        async with session(fenv.proxy, fenv.mcp_url) as mcp:
            tools = await mcp.list_tools()
            echoed = await mcp.call_tool("echo", {"text": "hello"})
            issue = await mcp.call_tool("create_issue", {"repo": "acme/widgets", "title": "t"})
            errors = {}
            for name, arguments in (
                ("delete_repo", {"repo": "acme/widgets"}),
                ("create_issue", {"repo": "evil/x", "title": "t"}),
            ):
                try:
                    await mcp.call_tool(name, arguments)
                except MCPError as exc:
                    errors[name] = str(exc)
            after = await mcp.call_tool("echo", {"text": "still here"})
            return {
                "tools": sorted(tool.name for tool in tools.tools),
                "echo": echoed.content[0].text,  # type: ignore[union-attr]
                "issue": issue.content[0].text,  # type: ignore[union-attr]
                "errors": errors,
                "after": after.content[0].text,  # type: ignore[union-attr]
            }

    mark = fenv.proxy.log.mark()
    outcome = run(scenario())
    # the list is the server's (the rule limits calls, not what the agent may learn)
    assert outcome["tools"] == ["create_issue", "delete_repo", "echo"]
    assert outcome["echo"] == "echo: hello" and outcome["issue"] == "opened acme/widgets: t"
    assert outcome["after"] == "echo: still here"  # the session survives a refusal
    assert (
        "umbra: denied (mcp_tool_denied): tool delete_repo is not allowed"
        in outcome["errors"]["delete_repo"]
    )
    assert "argument /repo does not match" in outcome["errors"]["create_issue"]
    record = fenv.proxy.log.wait_for(
        mark,
        lambda r: r["reason"] == "mcp_tool_denied" and "delete_repo" in r.get("detail", ""),
        timeout=20,
    )
    assert record["decision"] == "deny" and record["rule_id"] == "testing:tools"
    allowed = fenv.proxy.log.wait_for(
        mark, lambda r: "tools/call echo" in (r.get("detail") or ""), timeout=20
    )
    assert allowed["decision"] == "allow"


def raw_post(
    fenv: FieldsEnv, document: object | bytes, session_id: str | None = None
) -> httpx2.Response:
    async def go() -> httpx2.Response:
        headers = {
            "accept": "application/json, text/event-stream",
            "content-type": "application/json",
        }
        if session_id:
            headers["mcp-session-id"] = session_id
        body = document if isinstance(document, bytes) else json.dumps(document).encode()
        async with proxied_client(fenv.proxy) as client:
            return await client.post(fenv.mcp_url, content=body, headers=headers)

    return run(go())


def call(ident: int, name: str) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0", "id": ident, "method": "tools/call",
        "params": {"name": name, "arguments": {"text": "x"}},
    }  # fmt: skip


def test_a_batch_with_one_denied_call_is_refused_whole_with_an_error_per_request(
    fenv: FieldsEnv,
) -> None:
    response = raw_post(
        fenv,
        [call(1, "echo"), call(2, "delete_repo"), {"jsonrpc": "2.0", "method": "notifications/x"}],
    )
    assert response.status_code == 200
    errors = response.json()
    assert [e["id"] for e in errors] == [1, 2]
    assert all(e["error"]["data"]["reason"] == "mcp_tool_denied" for e in errors)


@pytest.mark.parametrize(
    ("document", "status", "reason"),
    [
        ({"jsonrpc": "2.0", "id": 7, "method": "resources/list"}, 200, "mcp_method_denied"),
        ({"jsonrpc": "2.0", "id": 8, "method": "prompts/get", "params": {"name": "p"}}, 200, "mcp_method_denied"),
        ({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {}}, 200, "mcp_malformed"),
        ({"jsonrpc": "1.0", "id": 1, "method": "tools/list"}, 400, "mcp_malformed"),
        ([], 400, "mcp_malformed"),
        (b"{truncated", 400, "body_unreadable"),
    ],
)  # fmt: skip
def test_malformed_and_other_methods_are_refused_with_their_reason(
    fenv: FieldsEnv, document: object, status: int, reason: str
) -> None:
    mark = fenv.proxy.log.mark()
    response = raw_post(fenv, document)
    assert response.status_code == status
    if status == 200:
        assert response.json()["error"]["data"]["reason"] == reason
    fenv.proxy.log.wait_for(mark, lambda r: r["reason"] == reason)


def test_a_tool_list_that_changes_after_approval_is_recorded(fenv: FieldsEnv) -> None:
    async def list_tools() -> list[str]:
        async with session(fenv.proxy, fenv.mcp_url) as mcp:
            return sorted(tool.name for tool in (await mcp.list_tools()).tools)

    run(list_tools())  # the first list this proxy sees is the approved one

    def exfiltrate(data: str) -> str:
        """Send data somewhere."""
        return "sent"

    fenv.mcp.server.add_tool(exfiltrate)
    mark = fenv.proxy.log.mark()
    try:
        names = run(list_tools())
    finally:
        fenv.mcp.server.remove_tool("exfiltrate")
    assert "exfiltrate" in names  # recorded, not hidden: the agent still cannot call it
    record = fenv.proxy.log.wait_for(mark, lambda r: r["reason"] == "mcp_tools_changed")
    assert record["decision"] == "allow" and "added exfiltrate" in record["detail"]


def test_the_approved_tool_list_survives_a_proxy_restart(
    fenv: FieldsEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The baseline is saved beside the budget counters: a proxy restarted after the server
    changed its list records the change instead of approving the new list."""
    workdir = tmp_path_factory.mktemp("mcp-restart")

    async def list_tools(proxy: ProxyProcess) -> list[str]:
        async with session(proxy, fenv.mcp_url) as mcp:
            return sorted(tool.name for tool in (await mcp.list_tools()).tools)

    proxy = start_proxy(fenv.args, workdir)
    try:
        run(list_tools(proxy))  # approved
    finally:
        proxy.stop()
    saved = json.loads((workdir / "spool" / "mcp-tools.json").read_text())
    assert [row[1:4] for row in saved["baselines"]] == [["mcp.test", fenv.mcp.port, "/mcp"]]
    assert oct((workdir / "spool" / "mcp-tools.json").stat().st_mode & 0o777) == "0o600"

    def exfiltrate(data: str) -> str:
        """Send data somewhere."""
        return "sent"

    fenv.mcp.server.add_tool(exfiltrate)
    proxy = start_proxy(fenv.args, workdir)
    try:
        mark = proxy.log.mark()
        run(list_tools(proxy))
        record = proxy.log.wait_for(mark, lambda r: r["reason"] == "mcp_tools_changed")
        assert "added exfiltrate" in record["detail"]
    finally:
        fenv.mcp.server.remove_tool("exfiltrate")
        proxy.stop()
