"""A record of its own for something observed during an allowed exchange (a changed MCP tool
list, unbelievable LLM usage): the exchange's own record still follows when it ends."""

from __future__ import annotations

from mitmproxy import http

from umbra.contracts.traffic import Decision, Kind
from umbra.proxy.addons.base import Shared
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import FlowState


def side_record(
    shared: Shared, flow: http.HTTPFlow, fstate: FlowState, reason: Reason, detail: str
) -> None:
    traffic = shared.traffic
    fields = traffic.base(flow.client_conn)
    decision = fstate.decision
    fields.update(
        kind=Kind.HTTP,
        method=flow.request.method,
        host=flow.request.host_header,
        policy_hash=fstate.effective.policy.hash if fstate.effective else None,
        decision=Decision.ALLOW,
        reason=str(reason),
        detail=detail[:300],
        path=decision.path if decision is not None else None,
        rule_id=decision.rule_id if decision is not None else None,
    )
    traffic.emit(fields, fstate)
