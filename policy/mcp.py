"""MCP tool rules: which JSON-RPC messages an agent may send to an MCP server (streamable HTTP).

An `mcp` allow rule admits the protocol's own methods (`initialize`, `ping`, `tools/list`, every
notification), answers to the server's requests, and `tools/call` for the named tools only, each
with its optional argument constraints (field constraints on `params.arguments`). Anything else
(`resources/*`, `prompts/*`, unknown methods) is refused: the reviewer approved tools, not the
server's other powers. A batch passes only when every message in it does.
"""

from __future__ import annotations

from umbra.policy.fields import violations
from umbra.policy.matcher import Reason
from umbra.policy.model import McpRule

PROTOCOL_METHODS = frozenset({"initialize", "ping", "tools/list"})
MAX_BATCH = 100
_NAME = 64

JsonRpcId = str | int | None


def messages(document: object) -> list[dict[str, object]]:
    """The JSON-RPC messages of a body (one, or a batch), or ValueError naming the fault."""
    items: list[object] = document if isinstance(document, list) else [document]
    if not items:
        raise ValueError("empty JSON-RPC batch")
    if len(items) > MAX_BATCH:
        raise ValueError(f"JSON-RPC batch of more than {MAX_BATCH} messages")
    batch: list[dict[str, object]] = []
    for message in items:
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            raise ValueError("not a JSON-RPC 2.0 message")
        batch.append(message)
        if "id" in message and (
            isinstance(message["id"], bool) or not isinstance(message["id"], str | int | None)
        ):
            raise ValueError("JSON-RPC id is neither a string nor an integer")
        if "method" in message:
            if not isinstance(message["method"], str):
                raise ValueError("JSON-RPC method is not a string")
        elif "id" not in message or ("result" in message) == ("error" in message):
            raise ValueError("neither a request, a notification nor a response")
    return batch


def request_ids(document: object) -> list[JsonRpcId]:
    """The ids of the requests in a body (what a refusal answers), [] when it holds none."""
    try:
        batch = messages(document)
    except ValueError:
        return []
    ids: list[JsonRpcId] = []
    for message in batch:
        if "method" in message and "id" in message:
            value = message["id"]
            assert value is None or isinstance(value, str | int)
            ids.append(value)
    return ids


def tool_calls(document: object) -> list[str]:
    """The tool names a body calls (for the record), bounded."""
    try:
        batch = messages(document)
    except ValueError:
        return []
    names = []
    for message in batch:
        params = message.get("params")
        if message.get("method") == "tools/call" and isinstance(params, dict):
            name = params.get("name")
            names.append(name[:_NAME] if isinstance(name, str) else "?")
    return names


def mcp_violation(document: object, rule: McpRule) -> tuple[Reason, str] | None:
    """Why the rule does not admit the body (reason, detail), or None."""
    try:
        batch = messages(document)
    except ValueError as exc:
        return Reason.MCP_MALFORMED, str(exc)
    tools = {tool.name: tool for tool in rule.tools}
    for message in batch:
        method = message.get("method")
        if method is None or not isinstance(method, str):
            continue  # an answer to the server's request
        if method in PROTOCOL_METHODS or method.startswith("notifications/"):
            continue
        if method != "tools/call":
            return Reason.MCP_METHOD_DENIED, f"method {method[:_NAME]} is not allowed"
        params = message.get("params")
        name = params.get("name") if isinstance(params, dict) else None
        if not isinstance(params, dict) or not isinstance(name, str):
            return Reason.MCP_MALFORMED, "tools/call without a tool name"
        tool = tools.get(name)
        if tool is None:
            return Reason.MCP_TOOL_DENIED, f"tool {name[:_NAME]} is not allowed"
        arguments = params.get("arguments", {})
        if not isinstance(arguments, dict):
            return Reason.MCP_MALFORMED, f"tools/call {name[:_NAME]}: arguments is not an object"
        if tool.arguments is not None:
            problems = violations(arguments, tool.arguments)
            if problems:
                return Reason.MCP_TOOL_DENIED, f"tool {name[:_NAME]}: argument {problems[0]}"
    return None
