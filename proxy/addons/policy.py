"""Policy decision (403 with the matcher's reason) for requests and for raw tunnels."""

from __future__ import annotations

from urllib.parse import parse_qsl

from mitmproxy import http

from umbra.proxy.addons.base import Denied, UmbraAddon, deny, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.sanity import connect_target
from umbra.proxy.addons.state import Stage, flow_state

_MAX_QUERY_KEYS = 64


class PolicyDecision(UmbraAddon):
    @guard
    def http_connect(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        if fstate.denied:
            return
        state = self.shared.conns.get(flow.client_conn)
        assert fstate.effective is not None and state.connect_host is not None
        assert state.connect_port is not None
        tunnel = fstate.effective.policy.decide_tunnel(state.connect_host, state.connect_port)
        if tunnel.allowed:
            state.tunnel_rule = tunnel.rule_id
            state.authorized.add((state.connect_host, state.connect_port))
            fstate.stage = Stage.ALLOWED
            self.shared.traffic.flow_record(
                flow,
                "allow",
                Reason.of_policy(tunnel.reason),
                kind="tunnel",
                rule_id=tunnel.rule_id,
                status=200,
            )

    @guard
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        if flow.request.method == "CONNECT" or fstate.denied:
            return
        try:
            assert fstate.effective is not None
            host, port, scheme = connect_target(flow, self.shared.conns.get(flow.client_conn))
            path = flow.request.path
            query = path.partition("?")[2]
            fstate.query_keys = sorted(
                {key[:64] for key, _ in parse_qsl(query, keep_blank_values=True)}
            )[:_MAX_QUERY_KEYS]
            decision = fstate.effective.policy.decide(flow.request.method, scheme, host, port, path)
            fstate.decision = decision
            if not decision.allowed:
                raise Denied(Reason.of_policy(decision.reason), decision.detail, decision.rule_id)
            fstate.stage = Stage.GATED
        except Denied as denial:
            deny(self.shared, flow, denial)
