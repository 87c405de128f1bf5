"""MCP tool lists: what an MCP server (reached by an `mcp` allow rule) says its tools are, compared
with the first list this proxy saw from it (the approved one); a list that differs is recorded as
`mcp_tools_changed` (a record of its own) with the tools added, removed or changed (description or
schema). The response passes unchanged and unbuffered: a tap beside the stream keeps at most
`MAX_LIST_BYTES` and reads them at each event's end and at the stream's, so a server streaming
forever stalls nothing.

The approved lists are saved to `mcp-tools.json` beside the budget counters (the process's spool
directory, atomically, mode 0600) whenever one is approved, and loaded at start, so a restart
does not approve a changed list anew.

The requests themselves are decided by `fields.RequestFields` (`umbra.policy.mcp`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from mitmproxy import http

from umbra.contracts.canonical import canonical_json
from umbra.contracts.files import write_atomic
from umbra.proxy.addons.base import Shared, UmbraAddon, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.records import side_record
from umbra.proxy.addons.state import FlowState, Stage, flow_state
from umbra.proxy.mcp_sse import EventTap, SseEvent

logger = logging.getLogger("umbra.proxy")
MAX_LIST_BYTES = 1 << 20
MAX_BASELINES = 10_000
FILE_NAME = "mcp-tools.json"
_MAX_NAMES = 8
_MAX_TOOLS = 4096

Fingerprint = dict[str, str]  # tool name -> hash of its description and schemas
Key = tuple[str, str, int, str]  # team, host, port, path


def baselines_to_json(approved: dict[Key, Fingerprint]) -> bytes:
    rows = [[*key, tools] for key, tools in sorted(approved.items())]
    return json.dumps({"version": 1, "baselines": rows}, separators=(",", ":")).encode()


def baselines_from_json(raw: bytes) -> dict[Key, Fingerprint]:
    """The saved baselines; a malformed row is dropped (that server's next list is approved anew,
    as before any was saved), an unreadable file counts as none."""
    try:
        document = json.loads(raw)
        rows = document["baselines"] if document.get("version") == 1 else []
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return {}
    approved: dict[Key, Fingerprint] = {}
    for row in rows[:MAX_BASELINES] if isinstance(rows, list) else []:
        if not (isinstance(row, list) and len(row) == 5):
            continue
        team, host, port, path, tools = row
        if (
            isinstance(team, str)
            and isinstance(host, str)
            and isinstance(port, int)
            and not isinstance(port, bool)
            and isinstance(path, str)
            and isinstance(tools, dict)
            and len(tools) <= _MAX_TOOLS
            and all(isinstance(k, str) and isinstance(v, str) for k, v in tools.items())
        ):
            approved[(team, host, port, path)] = tools
    return approved


def _asks_for_tools(body: bytes) -> bool:
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return False
    batch = document if isinstance(document, list) else [document]
    return any(isinstance(m, dict) and m.get("method") == "tools/list" for m in batch)


def _documents(body: bytes, content_type: str) -> list[object]:
    """The JSON documents of a response: one JSON body, or each `data:` event of a stream."""
    if "text/event-stream" in content_type:
        out: list[object] = []
        for event in body.replace(b"\r\n", b"\n").split(b"\n\n"):
            data = b"\n".join(
                line[5:].removeprefix(b" ")
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            )
            if data:
                try:
                    out.append(json.loads(data))
                except (ValueError, RecursionError):
                    continue
        return out
    try:
        return [json.loads(body)]
    except (ValueError, RecursionError):
        return []


def tools_of(body: bytes, content_type: str) -> Fingerprint | None:
    """The tools a `tools/list` answer names (None: no list in it)."""
    for document in _documents(body, content_type):
        for message in document if isinstance(document, list) else [document]:
            result = message.get("result") if isinstance(message, dict) else None
            tools = result.get("tools") if isinstance(result, dict) else None
            if not isinstance(tools, list):
                continue
            found: Fingerprint = {}
            for tool in tools:
                if isinstance(tool, dict) and isinstance(tool.get("name"), str):
                    try:
                        text = canonical_json({k: v for k, v in tool.items() if k != "name"})
                    except (TypeError, ValueError):
                        text = json.dumps(tool, sort_keys=True, default=str).encode()
                    found[tool["name"][:128]] = hashlib.sha256(text).hexdigest()
            return found
    return None


def describe_change(approved: Fingerprint, seen: Fingerprint) -> str:
    added = sorted(seen.keys() - approved.keys())
    removed = sorted(approved.keys() - seen.keys())
    changed = sorted(n for n in approved.keys() & seen.keys() if approved[n] != seen[n])
    parts = [
        f"{label} {', '.join(names[:_MAX_NAMES])}{' ...' if len(names) > _MAX_NAMES else ''}"
        for label, names in (("added", added), ("removed", removed), ("changed", changed))
        if names
    ]
    return "tool list differs from the first seen: " + "; ".join(parts)


class McpTools(UmbraAddon):
    def __init__(self, shared: Shared, path: Path | None = None) -> None:
        super().__init__(shared)
        # (team, host, port, path) -> the first tool list seen: per proxy process, saved to `path`
        self.path = path
        self.approved: dict[Key, Fingerprint] = {}
        if path is not None and path.exists():
            try:
                self.approved = baselines_from_json(path.read_bytes())
            except OSError as exc:
                logger.error("MCP tool baselines not read from %s (%s)", path, exc.strerror)

    @guard
    def request(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        decision = fstate.decision
        if fstate.denied or decision is None or not decision.allowed:
            return
        if not any(rule.mcp for rule in decision.field_rules or ()):
            return
        if flow.request.method == "POST" and _asks_for_tools(flow.request.content or b""):
            fstate.mcp_tools_list = True
            # an encoded answer could not be read beside the stream: ask for the identity
            flow.request.headers["accept-encoding"] = "identity"
        elif flow.request.method == "GET":
            fstate.mcp_event_stream = True  # maybe HTTP+SSE (proxy/mcp_sse.py)
            flow.request.headers["accept-encoding"] = "identity"

    @guard
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        response = flow.response
        if response is None or fstate.stage is not Stage.ALLOWED:
            return
        if fstate.mcp_refusal is not None:
            response.headers["x-umbra-reason"] = fstate.mcp_refusal
        inner = response.stream
        if (
            not callable(inner)
            or response.headers.get("content-encoding", "identity") != "identity"
        ):
            return
        kind = response.headers.get("content-type", "")
        if fstate.mcp_tools_list:
            response.stream = self._tap(flow, fstate, inner, kind)
        elif fstate.mcp_event_stream and "text/event-stream" in kind:
            response.stream = self._event_tap(flow, fstate, inner)

    def _event_tap(
        self,
        flow: http.HTTPFlow,
        fstate: FlowState,
        inner: Callable[[bytes], Iterable[bytes] | bytes],
    ) -> Callable[[bytes], list[bytes]]:
        """An event stream: HTTP+SSE endpoints and refusals (`EventTap`), and each event's
        tool list compared like a POST's answer."""
        request = flow.request
        identity = self.shared.conns.get(flow.client_conn).identity
        base = f"{request.scheme}://{request.pretty_host.lower()}:{request.port}{request.path}"

        def observe(event: SseEvent) -> None:
            if event.name != "message" or b'"tools"' not in event.data:
                return
            try:
                self._compare(flow, fstate, event.data, "application/json")
            except Exception as exc:  # the tap observes; a fault must not cut the stream
                logger.error("MCP tool list check failed (%s)", type(exc).__name__)

        tap = EventTap(
            self.shared.mcp_sse, identity.cvm_id if identity is not None else "", base, observe
        )

        def stream(chunk: bytes) -> list[bytes]:
            result = inner(chunk)
            out = result if isinstance(result, bytes) else b"".join(result)
            sent = (tap(out) if out else b"") + (tap(b"") if not chunk else b"")
            # never an empty chunk: mitmproxy would send it, and an empty chunk ends a chunked body
            return [sent] if sent else []

        return stream

    def _tap(
        self,
        flow: http.HTTPFlow,
        fstate: FlowState,
        inner: Callable[[bytes], Iterable[bytes] | bytes],
        content_type: str,
    ) -> Callable[[bytes], bytes]:
        kept: list[bytes] = []
        size = 0
        done = False

        def tap(chunk: bytes) -> bytes:
            nonlocal size, done
            result = inner(chunk)
            out = result if isinstance(result, bytes) else b"".join(result)
            if done:
                return out
            if chunk and size < MAX_LIST_BYTES:
                kept.append(out[: MAX_LIST_BYTES - size])
                size += len(kept[-1])
            # an event stream is read at each event's end: the client may close it once it has
            # the answer, before the stream ends
            if not chunk or b"\n\n" in out or b"\r\n\r\n" in out:
                try:
                    done = self._compare(flow, fstate, b"".join(kept), content_type)
                except Exception as exc:  # the tap observes; a fault must not cut the stream
                    logger.error("MCP tool list check failed (%s)", type(exc).__name__)
                    done = True
            return out

        return tap

    def _compare(self, flow: http.HTTPFlow, fstate: FlowState, body: bytes, kind: str) -> bool:
        """Compare a tool list once it is complete; True when one was read."""
        seen = tools_of(body, kind)
        if seen is None:
            return False
        state = self.shared.conns.get(flow.client_conn)
        identity = state.identity
        decision = fstate.decision
        host = decision.host if decision is not None and decision.host else flow.request.host
        path = decision.path if decision is not None and decision.path else ""
        port = state.connect_port or flow.request.port
        key = (identity.team if identity is not None else "", host, port, path)
        approved = self.approved.get(key)
        if approved is None:
            if len(self.approved) < MAX_BASELINES:
                self.approved[key] = seen
                self._save()
            return True
        if approved != seen:
            side_record(
                self.shared, flow, fstate, Reason.MCP_TOOLS_CHANGED, describe_change(approved, seen)
            )
        return True

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            write_atomic(self.path, baselines_to_json(self.approved), 0o600)
        except OSError as exc:
            logger.error("MCP tool baselines not saved to %s (%s)", self.path, exc.strerror)
