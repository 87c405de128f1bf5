"""Request-field and MCP tool rules: the body of a request whose allow rules read it (`body`,
`mcp`) is decoded (Content-Encoding), read as one document and decided by
`umbra.policy.body.decide_body` before anything is forwarded.

A refusal is 403 `body_field_denied`, 400 `body_unreadable`, 413 `body_limit`, or for an MCP
rule `mcp_tool_denied`/`mcp_method_denied`/`mcp_malformed`; an MCP refusal of a body holding
requests is answered as JSON-RPC errors, one per request id (HTTP 200), which an MCP client
hands to the agent as the call's error. On MCP's HTTP+SSE transport the answer must come on the
event stream instead (proxy/mcp_sse.py).
"""

from __future__ import annotations

import json

from mitmproxy import http

from umbra.policy import Decision
from umbra.policy.body import BodyRequest, decide_body
from umbra.policy.fields import MAX_BODY_BYTES, BodyError, parse_body
from umbra.policy.mcp import request_ids, tool_calls
from umbra.proxy.addons.base import Denied, UmbraAddon, deny, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import Stage, flow_state
from umbra.proxy.decode import DecodeError, DecodeLimit, content_decode
from umbra.proxy.mcp_sse import stand_in

MCP_REASONS = frozenset({Reason.MCP_TOOL_DENIED, Reason.MCP_METHOD_DENIED, Reason.MCP_MALFORMED})
# JSON-RPC's range for implementation-defined server errors is -32000..-32099.
JSONRPC_DENIED = -32001


class RequestFields(UmbraAddon):
    @guard
    def request(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        decision = fstate.decision
        if fstate.denied or fstate.stage is not Stage.GATED or decision is None:
            return
        if not decision.allowed or not decision.field_rules:
            return
        request = flow.request
        body = request.raw_content or b""
        encoding = ",".join(request.headers.get_all("content-encoding"))
        try:
            decoded = content_decode(body, encoding, MAX_BODY_BYTES) if encoding else body
        except DecodeLimit as exc:
            deny(self.shared, flow, Denied(Reason.BODY_LIMIT, str(exc), decision.rule_id))
            return
        except DecodeError as exc:
            deny(self.shared, flow, Denied(Reason.BODY_UNREADABLE, str(exc), decision.rule_id))
            return
        probe = BodyRequest(
            tuple(request.headers.get_all("content-type")),
            decoded,
            request.path.partition("?")[2],
            request.method,
        )
        verdict = decide_body(decision, probe)
        if verdict.allowed:
            fstate.decision = verdict
            calls = _calls(probe) if any(r.mcp for r in decision.field_rules) else []
            if calls:
                fstate.note = "mcp tools/call " + ", ".join(calls[:8])
            return
        reason = Reason.of_policy(verdict.reason)
        ids = _ids(probe) if reason in MCP_REASONS else []
        if ids:
            self._jsonrpc_refusal(flow, verdict, reason, ids, isinstance(_document(probe), list))
        else:
            deny(self.shared, flow, Denied(reason, verdict.detail, verdict.rule_id))

    def _jsonrpc_refusal(
        self,
        flow: http.HTTPFlow,
        verdict: Decision,
        reason: Reason,
        ids: list[object],
        batch: bool,
    ) -> None:
        """Answer each request of the body with a JSON-RPC error the agent reads as the call's
        result; nothing is forwarded, one record is written."""
        fstate = flow_state(flow)
        rule = verdict.rule_id or "?"
        text = self.shared.traffic.clean(
            f"umbra: denied ({reason}): {verdict.detail}; rule {rule}; to allow it, propose a "
            f"change to rule {rule} (policies/), reviewed like any widening.",
            fstate,
        )
        data = {"reason": str(reason), "rule_id": verdict.rule_id}
        errors: list[dict[str, object]] = [
            {
                "jsonrpc": "2.0",
                "id": ident,
                "error": {"code": JSONRPC_DENIED, "message": text, "data": data},
            }
            for ident in ids
        ]
        if self._answer_on_event_stream(flow, verdict, reason, errors):
            return
        document: object = errors if batch else errors[0]
        flow.response = http.Response.make(
            200,
            json.dumps(document).encode(),
            {"content-type": "application/json", "x-umbra-reason": str(reason)},
        )
        fstate.decision = verdict
        fstate.stage = Stage.DENIED
        self.shared.traffic.flow_record(
            flow, "deny", reason, verdict.detail, status=200, rule_id=verdict.rule_id
        )

    def _answer_on_event_stream(
        self,
        flow: http.HTTPFlow,
        verdict: Decision,
        reason: Reason,
        errors: list[dict[str, object]],
    ) -> bool:
        """A refused POST to an endpoint an HTTP+SSE event stream announced: its answer must come
        on that stream, so a stand-in `ping` goes in place of the body and the event tap answers
        with `errors` (proxy/mcp_sse.py). False when no such stream is known here."""
        request = flow.request
        identity = self.shared.conns.get(flow.client_conn).identity
        key = (
            identity.cvm_id if identity is not None else "",
            request.pretty_host.lower(),
            request.port,
            request.path,
        )
        stream = self.shared.mcp_sse.stream_for(key)
        ping = stand_in(stream, errors) if stream is not None else None
        if ping is None:
            return False
        for name in ("content-encoding", "transfer-encoding"):
            request.headers.pop(name, None)
        request.content = ping
        fstate = flow_state(flow)
        fstate.mcp_refusal = str(reason)
        self.shared.traffic.flow_record(
            flow, "deny", reason, verdict.detail, status=202, rule_id=verdict.rule_id
        )
        return True


def _document(probe: BodyRequest) -> object:
    try:
        return parse_body(probe)
    except BodyError:
        return None


def _ids(probe: BodyRequest) -> list[object]:
    return list(request_ids(_document(probe)))


def _calls(probe: BodyRequest) -> list[str]:
    return tool_calls(_document(probe))
