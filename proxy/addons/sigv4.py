"""AWS SigV4 re-signing (`proxy/sigv4.py`): after injection, a request to a host an `aws-sigv4`
injection binds is signed again with the real key, in the form the sandbox signed it with its
placeholder keys; a missing, malformed or out-of-scope signature is refused."""

from __future__ import annotations

from mitmproxy import http

from umbra.contracts.secret_kinds import AwsSigv4
from umbra.policy import normalize_host
from umbra.proxy.addons.base import Denied, UmbraAddon, deny, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import Stage, flow_state
from umbra.proxy.sigv4 import Sigv4Error, resign

REASONS = {
    "missing": Reason.SIGV4_MISSING,
    "malformed": Reason.SIGV4_MALFORMED,
    "scope_refused": Reason.SIGV4_SCOPE_REFUSED,
    "unsupported": Reason.SIGV4_UNSUPPORTED,
}


class Sigv4(UmbraAddon):
    @guard
    def request(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        request = flow.request
        if request.method == "CONNECT" or fstate.denied or fstate.stage is not Stage.ALLOWED:
            return
        if fstate.effective is None or fstate.decision is None:
            return
        state = self.shared.conns.get(flow.client_conn)
        identity = state.identity
        host = state.connect_host or normalize_host(request.host)
        port = request.port if state.connect_port is None else state.connect_port
        rules = [
            rule
            for rule in fstate.effective.policy.applicable_injections(host, port, fstate.decision)
            if rule.sigv4 is not None
        ]
        if not rules or identity is None:
            return
        rule = rules[0]  # composition allows one Authorization placement per host and port
        assert rule.sigv4 is not None
        material = self.shared.state.secrets.material(rule.secret, identity.owner, host)
        if material is None or not isinstance(material.document, AwsSigv4):
            deny(self.shared, flow, Denied(
                Reason.SECRET_UNAVAILABLE,
                f"injection {rule.id} needs aws-sigv4 secret {rule.secret}, which is not set",
                rule.id, rule.secret,
            ))  # fmt: skip
            return
        try:
            resigned = resign(
                method=request.method,
                path=request.path,
                host=request.host_header or host,
                headers=request.headers,
                body=request.raw_content or b"",
                secret=material.document,
                services=rule.sigv4.services,
                regions=rule.sigv4.regions,
            )
        except Sigv4Error as exc:
            deny(self.shared, flow, Denied(REASONS[exc.code], exc.detail, rule.id))
            return
        request.path = resigned.path
        if resigned.body is not None:
            request.raw_content = resigned.body
        fstate.injected_headers = [*fstate.injected_headers, "authorization"]
        fstate.injected_values = [*fstate.injected_values, *resigned.placed]
