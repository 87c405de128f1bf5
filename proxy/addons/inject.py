"""Injection: credentials for the flow's own connect target, then the dial is authorized."""

from __future__ import annotations

from mitmproxy import http

from umbra.policy import normalize_host
from umbra.proxy.addons.base import Denied, UmbraAddon, deny, guard
from umbra.proxy.addons.mint import MINTED
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import FlowState, Stage, flow_state
from umbra.proxy.inject import InjectionError, apply_injections, render_injections
from umbra.proxy.mitm_compat import STREAM_RESPONSE


class Inject(UmbraAddon):
    @guard
    def request(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        if flow.request.method == "CONNECT" or fstate.denied or fstate.stage is not Stage.GATED:
            return
        try:
            self.inject(flow, fstate)
            fstate.stage = Stage.ALLOWED
            # Every allowed response streams, at any size (the response guard checks it).
            flow.metadata[STREAM_RESPONSE] = True
        except Denied as denial:
            deny(self.shared, flow, denial)

    def inject(self, flow: http.HTTPFlow, fstate: FlowState) -> None:
        assert fstate.effective is not None
        state = self.shared.conns.get(flow.client_conn)
        request = flow.request
        host = state.connect_host or normalize_host(request.host)
        port = request.port if state.connect_port is None else state.connect_port
        # Bound to the connect target's host and port (another service on the same host never gets
        # the credential), and to the profiles that allow this request.
        if fstate.decision is None:
            raise Denied(Reason.NOT_DECIDED, "request was not checked")
        injections = fstate.effective.policy.applicable_injections(host, port, fstate.decision)
        bound = {ref for rule in injections for ref in rule.refs}
        unbound = sorted(fstate.placeholders - bound)
        if unbound:
            fstate.scan_rule_ids = [f"placeholder:{ref}" for ref in unbound]
            raise Denied(
                Reason.PLACEHOLDER_UNBOUND, "placeholder for a secret not bound to this host"
            )
        if injections:
            if request.scheme != "https":
                raise Denied(
                    Reason.INJECTION_REQUIRES_TLS, "credentials are only injected over TLS"
                )
            identity = state.identity
            assert identity is not None
            secrets = self.shared.state.secrets
            try:
                minted = flow.metadata.get(MINTED)  # by the minting addon, for OAuth kinds
                rendered = render_injections(injections, secrets, identity.owner, host, minted)
            except InjectionError as exc:
                raise Denied(
                    Reason.SECRET_UNAVAILABLE, str(exc), exc.rule_id, exc.secret_ref
                ) from None
            except ValueError:
                raise Denied(Reason.SECRET_UNAVAILABLE, "secret value cannot be rendered") from None
            # The query placement changes only the query: the path the policy decided on stays.
            request.path, injected = apply_injections(request.headers, request.path, rendered)
            fstate.injected_headers = injected.header_names
            fstate.injected_values = injected.values
        state.authorized.add((host, port))
