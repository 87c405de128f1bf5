"""Request-field rules (`body`) and MCP tool rules (`mcp`) in the policy engine: the file format
and its errors, reading a body into one document (bounded, fail closed), constraints by JSON
Pointer, the union of allow rules, `policy test` cases with bodies and `policy diff`."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from tests.policy.helpers import policy, profile
from umbra.policy import Reason
from umbra.policy.body import decide_body
from umbra.policy.diff import diff_policy_sets
from umbra.policy.errors import PolicyError
from umbra.policy.fields import (
    MAX_DEPTH,
    MAX_ITEMS,
    MISSING,
    BodyError,
    BodyRequest,
    parse_body,
    resolve,
)
from umbra.policy.loader import load_policy_dir
from umbra.policy.runner import run_suites

SLACK_RULE: dict[str, Any] = {
    "id": "post",
    "allow": {"hosts": ["slack.com"], "methods": ["POST"], "paths": ["/api/chat.postMessage"]},
    "body": [
        {"pointer": "/channel", "one_of": ["C1", "C2"]},
        {"pointer": "/as_user", "absent": True},
    ],
}


def slack_decide(body: bytes, content_type: str = "application/json", query: str = "") -> Any:
    effective = policy(profile("slack", [SLACK_RULE]))
    path = "/api/chat.postMessage" + (f"?{query}" if query else "")
    decision = effective.decide("POST", "https", "slack.com", 443, path)
    assert decision.allowed and decision.field_rules
    return decide_body(decision, BodyRequest((content_type,), body, query))


def test_slack_post_message_only_to_the_listed_channels() -> None:
    allowed = slack_decide(json.dumps({"channel": "C1", "text": "hi"}).encode())
    assert allowed.allowed and allowed.rule_id == "slack:post"
    form = slack_decide(b"channel=C2&text=hi", "application/x-www-form-urlencoded")
    assert form.allowed
    for body in (
        {"channel": "C3", "text": "hi"},
        {"channel": ["C1", "C3"]},  # a list is not one of the strings
        {"text": "no channel"},
        {"channel": "C1", "as_user": True},
        {"channel": "c1"},
    ):
        denied = slack_decide(json.dumps(body).encode())
        assert not denied.allowed and denied.reason is Reason.BODY_FIELD_DENIED, body
        assert "C3" not in denied.detail  # the agent's value is not repeated into records
    # the query's parameters are fields too: a second channel there is refused, not ignored
    assert slack_decide(
        b"channel=C1", "application/x-www-form-urlencoded", "channel=C3"
    ).reason is (Reason.BODY_UNREADABLE)
    assert slack_decide(b"", "application/x-www-form-urlencoded", "channel=C3").reason is (
        Reason.BODY_FIELD_DENIED
    )
    assert slack_decide(b"", "application/x-www-form-urlencoded", "channel=C2").allowed


@pytest.mark.parametrize(
    ("body", "content_type", "reason"),
    [
        (b'{"channel": "C1", "channel": "C3"}', "application/json", Reason.BODY_UNREADABLE),
        (b"channel=C1&channel=C3", "application/x-www-form-urlencoded", Reason.BODY_UNREADABLE),
        (b'{"channel": "C1"', "application/json", Reason.BODY_UNREADABLE),
        (b'{"channel": NaN}', "application/json", Reason.BODY_UNREADABLE),
        (b'\xef\xbb\xbf{"channel": "C1"}', "application/json", Reason.BODY_UNREADABLE),
        ('{"channel": "C1"}'.encode("utf-16"), "application/json", Reason.BODY_UNREADABLE),
        (b'{"channel": "C1"}', "text/plain", Reason.BODY_UNREADABLE),
        (b'{"channel": "C1"}', "application/x-www-form-urlencoded", Reason.BODY_UNREADABLE),
        (b"--b\r\nx\r\n--b--", "multipart/form-data; boundary=b", Reason.BODY_UNREADABLE),
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "application/json", Reason.BODY_LIMIT),
        (b"[" * 100_000, "application/json", Reason.BODY_LIMIT),
        (b"[" + b"0," * MAX_ITEMS + b"0]", "application/json", Reason.BODY_LIMIT),
        (b" " * ((1 << 20) + 1), "application/json", Reason.BODY_LIMIT),
        (b"1" * 5000, "application/json", Reason.BODY_UNREADABLE),  # beyond int's digit limit
    ],
)
def test_a_body_that_cannot_be_read_as_one_document_is_denied(
    body: bytes, content_type: str, reason: Reason
) -> None:
    decision = slack_decide(body, content_type)
    assert not decision.allowed and decision.reason is reason


def test_two_content_types_are_refused() -> None:
    with pytest.raises(BodyError) as excinfo:
        parse_body(BodyRequest(("application/json", "text/plain"), b"{}"))
    assert excinfo.value.reason is Reason.BODY_UNREADABLE


def test_json_unicode_escapes_are_read_as_the_server_reads_them() -> None:
    assert slack_decide(b'{"\\u0063hannel": "C\\u0033"}').reason is Reason.BODY_FIELD_DENIED
    assert slack_decide(b'{"\\u0063hannel": "C\\u0031"}').allowed


def test_json_pointer_resolution() -> None:
    document = {"a": {"b/c": [10, {"~k": True}]}, "": 1}
    assert resolve(document, "/a/b~1c/0") == 10
    assert resolve(document, "/a/b~1c/1/~0k") is True
    assert resolve(document, "/") == 1
    assert resolve(document, "") is document
    for missing in ("/a/b~1c/2", "/a/b~1c/01", "/a/b~1c/-", "/a/x", "/a/b~1c/0/deeper"):
        assert resolve(document, missing) is MISSING


@pytest.mark.parametrize(
    ("constraint", "passing", "failing"),
    [
        ({"pointer": "/n", "equals": 1}, {"n": 1}, [{"n": True}, {"n": 1.0}, {"n": "1"}, {}]),
        ({"pointer": "/n", "equals": None}, {"n": None}, [{}, {"n": 0}]),
        ({"pointer": "/n", "one_of": [False, "x"]}, {"n": False}, [{"n": 0}, {"n": "y"}]),
        ({"pointer": "/n", "pattern": "[a-z]+"}, {"n": "abc"}, [{"n": "abc1"}, {"n": 5}, {}]),
        ({"pointer": "/n", "absent": True}, {"m": 1}, [{"n": None}]),
    ],
)
def test_constraint_kinds(
    constraint: dict[str, Any], passing: dict[str, Any], failing: list[dict[str, Any]]
) -> None:
    rule = {"allow": {"hosts": ["x.test"]}, "body": [constraint]}
    effective = policy(profile("p", [rule]))
    decision = effective.decide("POST", "https", "x.test", 443, "/")
    ok = decide_body(decision, BodyRequest(("application/json",), json.dumps(passing).encode()))
    assert ok.allowed
    for body in failing:
        refused = decide_body(
            decision, BodyRequest(("application/json",), json.dumps(body).encode())
        )
        assert refused.reason is Reason.BODY_FIELD_DENIED, body


def test_allows_are_a_union_and_a_rule_without_limits_lifts_them() -> None:
    limited = {**SLACK_RULE}
    other = {
        "id": "general",
        "allow": {"hosts": ["slack.com"], "paths": ["/api/**"]},
        "body": [{"pointer": "/channel", "equals": "C9"}],
    }
    effective = policy(profile("slack", [limited, other]))
    decision = effective.decide("POST", "https", "slack.com", 443, "/api/chat.postMessage")
    assert [rule.id for rule in decision.field_rules or ()] == ["slack:post", "slack:general"]
    nine = decide_body(decision, BodyRequest(("application/json",), b'{"channel": "C9"}'))
    assert nine.allowed and nine.rule_id == "slack:general"
    three = decide_body(decision, BodyRequest(("application/json",), b'{"channel": "C3"}'))
    assert not three.allowed and three.rule_id == "slack:post"
    open_rule = {"allow": {"hosts": ["slack.com"]}}
    lifted = policy(profile("slack", [limited, open_rule]))
    assert (
        lifted.decide("POST", "https", "slack.com", 443, "/api/chat.postMessage").field_rules
        is None
    )


def test_a_profile_without_field_rules_compiles_and_hashes_as_before() -> None:
    compiled = profile("plain", [{"allow": {"hosts": ["x.test"]}}])
    assert set(compiled.model_dump(mode="json")["rules"][0]) == {
        "id", "action", "hosts", "methods", "endpoints", "paths", "push_refs",
    }  # fmt: skip
    with_body = profile("slack", [SLACK_RULE])
    rule = with_body.model_dump(mode="json")["rules"][0]
    assert rule["body"] == [
        {"pointer": "/channel", "one_of": ["C1", "C2"]},
        {"pointer": "/as_user", "absent": True},
    ]
    assert type(with_body).model_validate(with_body.model_dump(mode="json")) == with_body


HEADER = "apiVersion: umbra/v1\nkind: Profile\nname: p\negress:\n"


@pytest.mark.parametrize(
    ("entry", "field", "fragment"),
    [
        ("{deny: {hosts: [x.com]}, body: [{pointer: /a, absent: true}]}", "egress[0]", "allow"),
        ("{allow: {hosts: [x.com]}, body: [{pointer: a, absent: true}]}", "egress[0].body[0].pointer", "JSON Pointer"),
        ("{allow: {hosts: [x.com]}, body: [{pointer: /a, absent: true, equals: 1}]}", "egress[0].body[0]", "exactly one"),
        ("{allow: {hosts: [x.com]}, body: [{pointer: /a}]}", "egress[0].body[0]", "exactly one"),
        ("{allow: {hosts: [x.com]}, body: [{pointer: /a, equals: 1.5}]}", "egress[0].body[0].equals", ""),
        ("{allow: {hosts: [x.com]}, body: [{pointer: /a, pattern: '(?=x)'}]}", "egress[0].body[0].pattern", "look-around"),
        ("{allow: {hosts: [x.com]}, body: [{pointer: /a, one_of: []}]}", "egress[0].body[0].one_of", ""),
        ("{allow: {hosts: [x.com]}, body: []}", "egress[0].body", ""),
        ("{allow: {hosts: [x.com]}, mcp: {tools: [{name: a}, {name: a}]}}", "egress[0].mcp.tools", "twice"),
        ("{allow: {hosts: [x.com]}, mcp: {tools: [{name: 'a b'}]}}", "egress[0].mcp.tools[0].name", "tool name"),
        ("{allow: {hosts: [x.com]}, mcp: {tools: [{name: a}]}, body: [{pointer: /a, absent: true}]}", "egress[0]", "one body limit"),
    ],
)  # fmt: skip
def test_field_rule_errors_name_file_line_and_field(
    tmp_path: Path, entry: str, field: str, fragment: str
) -> None:
    (tmp_path / "p.yaml").write_text(HEADER + f"  - {entry}\n")
    with pytest.raises(PolicyError) as excinfo:
        load_policy_dir(tmp_path)
    issue = excinfo.value.issues[0]  # a value no member of a union accepts: one per member
    assert (Path(issue.file).name, issue.line) == ("p.yaml", 5)
    assert issue.field.startswith(field) and fragment in issue.message


SLACK_PROFILE = """apiVersion: umbra/v1
kind: Profile
name: slack
egress:
  - id: post
    allow: {hosts: [slack.com], methods: [POST], paths: [/api/chat.postMessage]}
    body:
      - {pointer: /channel, one_of: [C1, C2]}
"""

SLACK_SUITE = """apiVersion: umbra/v1
kind: PolicyTest
name: slack
profiles: [slack]
cases:
  - request: POST https://slack.com/api/chat.postMessage
    json: {channel: C1, text: hello}
    expect: allow
    rule: slack:post
  - request: POST https://slack.com/api/chat.postMessage
    body: channel=C3&text=hello
    content_type: application/x-www-form-urlencoded
    expect: deny
    reason: body_field_denied
  - request: POST https://slack.com/api/chat.postMessage
    body: "{not json"
    expect: deny
    reason: body_unreadable
  - request: POST https://slack.com/api/chat.postMessage
    expect: deny
    reason: body_field_denied
"""


def test_policy_test_cases_carry_bodies(tmp_path: Path) -> None:
    (tmp_path / "slack.yaml").write_text(SLACK_PROFILE)
    (tmp_path / "slack-test.yaml").write_text(SLACK_SUITE)
    results = run_suites(load_policy_dir(tmp_path))
    assert [r.problems for r in results] == [()] * 4
    (tmp_path / "slack-test.yaml").write_text(
        SLACK_SUITE.replace("json: {channel: C1", "json: {channel: C4")
    )
    results = run_suites(load_policy_dir(tmp_path))
    assert "expected allow, got deny (body_field_denied)" in results[0].problems[0]


def test_a_case_with_a_body_and_a_tunnel_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "slack.yaml").write_text(SLACK_PROFILE)
    (tmp_path / "t.yaml").write_text(
        "apiVersion: umbra/v1\nkind: PolicyTest\nname: t\nprofiles: [slack]\ncases:\n"
        "  - {tunnel: 'slack.com:22', json: {a: 1}, expect: deny}\n"
    )
    with pytest.raises(PolicyError) as excinfo:
        load_policy_dir(tmp_path)
    assert "no body" in excinfo.value.issues[0].message


def _load(tmp_path: Path, name: str, text: str) -> Any:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "slack.yaml").write_text(text)
    return load_policy_dir(directory)


@pytest.mark.parametrize(
    ("before", "after", "widens"),
    [
        ("[C1, C2]", "[C1, C2, C3]", True),
        ("[C1, C2, C3]", "[C1, C2]", True),  # any change to a limit is reviewed as a widening
    ],
)
def test_diff_shows_a_changed_body_limit(
    tmp_path: Path, before: str, after: str, widens: bool
) -> None:
    a = _load(tmp_path, "a", SLACK_PROFILE.replace("[C1, C2]", before))
    b = _load(tmp_path, "b", SLACK_PROFILE.replace("[C1, C2]", after))
    assert diff_policy_sets(a, b).widens is widens


def test_diff_of_dropping_a_body_limit_widens_and_adding_one_does_not(tmp_path: Path) -> None:
    limited = _load(tmp_path, "a", SLACK_PROFILE)
    open_ = _load(tmp_path, "b", SLACK_PROFILE.split("    body:")[0])
    dropped = diff_policy_sets(limited, open_)
    assert dropped.widens
    assert any(c.grant[-2:] == ("POST", "/api/chat.postMessage") for c in dropped.added)
    assert not diff_policy_sets(open_, limited).widens


MCP_PROFILE = """apiVersion: umbra/v1
kind: Profile
name: tools
egress:
  - id: mcp
    allow: {hosts: [mcp.test], paths: [/mcp]}
    mcp:
      tools:
        - {name: echo}
"""


def test_diff_of_mcp_tools_widens_on_an_added_tool_only(tmp_path: Path) -> None:
    one = _load(tmp_path, "a", MCP_PROFILE)
    two = _load(tmp_path, "b", MCP_PROFILE + "        - {name: delete_repo}\n")
    added = diff_policy_sets(one, two)
    assert added.widens
    assert [c.grant[-2:] for c in added.added] == [("mcp-tool", "delete_repo")]
    assert not diff_policy_sets(two, one).widens


def test_a_gzip_body_is_read_by_the_proxy_not_the_engine() -> None:
    # The engine reads decoded bytes; compressed bytes are not JSON.
    decision = slack_decide(gzip.compress(b'{"channel": "C1"}'))
    assert decision.reason is Reason.BODY_UNREADABLE


MCP_SUITE = """apiVersion: umbra/v1
kind: PolicyTest
name: tools
profiles: [tools]
cases:
  - request: POST https://mcp.test/mcp
    json: {jsonrpc: "2.0", id: 1, method: tools/call, params: {name: echo, arguments: {text: hi}}}
    expect: allow
  - request: POST https://mcp.test/mcp
    json: {jsonrpc: "2.0", id: 1, method: tools/call, params: {name: delete_repo}}
    expect: deny
    reason: mcp_tool_denied
  - request: POST https://mcp.test/mcp
    json: [{jsonrpc: "2.0", id: 1, method: initialize, params: {}}, {jsonrpc: "2.0", method: notifications/initialized}]
    expect: allow
  - request: GET https://mcp.test/mcp
    expect: allow
  - request: POST https://mcp.test/mcp
    json: {jsonrpc: "2.0", id: 2, method: resources/read, params: {uri: "file:///etc/passwd"}}
    expect: deny
    reason: mcp_method_denied
"""


def test_policy_test_cases_for_mcp_tools(tmp_path: Path) -> None:
    (tmp_path / "tools.yaml").write_text(MCP_PROFILE)
    (tmp_path / "tools-test.yaml").write_text(MCP_SUITE)
    results = run_suites(load_policy_dir(tmp_path))
    assert [r.problems for r in results] == [()] * 5


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        ({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "echo", "arguments": []}}, Reason.MCP_MALFORMED),
        ({"jsonrpc": "2.0", "id": True, "method": "ping"}, Reason.MCP_MALFORMED),
        ({"jsonrpc": "2.0", "id": 1}, Reason.MCP_MALFORMED),
        ({"jsonrpc": "2.0", "id": 1, "result": {}, "error": {}}, Reason.MCP_MALFORMED),
        ([{"jsonrpc": "2.0", "method": "ping", "id": n} for n in range(101)], Reason.MCP_MALFORMED),
        ({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "echo", "arguments": {"text": "x"}}}, None),
        ({"jsonrpc": "2.0", "id": 1, "result": {}}, None),  # an answer to the server's request
    ],
)  # fmt: skip
def test_json_rpc_shapes(document: object, reason: Reason | None) -> None:
    from umbra.policy.mcp import mcp_violation
    from umbra.policy.model import McpRule

    outcome = mcp_violation(document, McpRule.model_validate({"tools": [{"name": "echo"}]}))
    assert (outcome[0] if outcome else None) is reason


def test_policy_diff_fail_on_widen_through_git(tmp_path: Path) -> None:
    import subprocess

    from typer.testing import CliRunner

    from umbra.cli.app import app

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "policies").mkdir()
    profile = tmp_path / "policies" / "slack.yaml"
    profile.write_text(SLACK_PROFILE)
    git("add", ".")
    git("commit", "-qm", "limited")
    profile.write_text(SLACK_PROFILE.replace("[C1, C2]", "[C1, C2, C3]"))
    git("commit", "-qam", "one more channel")
    runner = CliRunner()
    widened = runner.invoke(
        app, ["policy", "diff", "HEAD~1", "HEAD", "--repo", str(tmp_path), "--fail-on-widen"]
    )
    assert widened.exit_code == 1, widened.output
    assert "C3" in widened.output
