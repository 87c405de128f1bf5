"""Identity: which CVM a connection and each request belongs to (407 when unknown).

Also the owner of connection state: created on connect, dropped on disconnect.
"""

from __future__ import annotations

from mitmproxy import connection, http

from umbra.policy import NormalizationError, normalize_host
from umbra.proxy.addons.base import Denied, UmbraAddon, deny, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import ConnState, flow_state
from umbra.proxy.identity import CvmIdentity

_STRIP_REQUEST = ("proxy-authorization", "proxy-connection")


class Identity(UmbraAddon):
    @guard
    def client_connected(self, client: connection.Client) -> None:
        state = self.shared.conns.get(client)
        host, port = client.peername[0], client.peername[1]
        state.identity = self.shared.identities.by_source(str(host), int(port))

    def client_disconnected(self, client: connection.Client) -> None:
        self.shared.conns.drop(client)

    def authenticate(self, flow: http.HTTPFlow, state: ConnState) -> CvmIdentity:
        header_values = flow.request.headers.get_all("proxy-authorization")
        for name in _STRIP_REQUEST:
            while name in flow.request.headers:
                del flow.request.headers[name]
        if len(header_values) > 1:
            raise Denied(Reason.UNKNOWN_IDENTITY, "more than one Proxy-Authorization header")
        if header_values:
            identity = self.shared.identities.by_proxy_auth(header_values[0])
            if identity is None:
                raise Denied(Reason.UNKNOWN_IDENTITY, "proxy credentials not recognised")
            if state.identity is not None and state.identity.cvm_id != identity.cvm_id:
                raise Denied(Reason.IDENTITY_CONFLICT, "credentials name a different CVM")
            state.identity = identity
        if state.identity is None:
            raise Denied(Reason.UNKNOWN_IDENTITY, "no tunnel identity for this connection")
        return state.identity

    def _effective(self, flow: http.HTTPFlow, identity: CvmIdentity) -> None:
        effective = self.shared.state.effective(identity)
        flow_state(flow).effective = effective
        if effective.error:
            raise Denied(Reason.POLICY_UNAVAILABLE, effective.error)

    @guard
    def http_connect(self, flow: http.HTTPFlow) -> None:
        state = self.shared.conns.get(flow.client_conn)
        try:
            identity = self.authenticate(flow, state)
            if state.connect_host is not None:
                raise Denied(Reason.NESTED_CONNECT, "CONNECT inside a CONNECT tunnel")
            raw = flow.request.host
            try:
                host = normalize_host(raw)
            except NormalizationError as exc:
                raise Denied(Reason.INVALID_HOST, str(exc)) from None
            state.connect_raw, state.connect_host = raw[:260], host
            state.connect_port = flow.request.port
            # Policy trouble is answered on the first request, which names what it wanted.
            flow_state(flow).effective = self.shared.state.effective(identity)
        except Denied as denial:
            deny(self.shared, flow, denial)

    @guard
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT" or flow_state(flow).denied:
            return
        state = self.shared.conns.get(flow.client_conn)
        try:
            if state.poisoned:
                raise Denied(Reason.INTERNAL_ERROR, state.poisoned)
            self._effective(flow, self.authenticate(flow, state))
            if state.tunnel_rule is not None:
                raise Denied(Reason.TUNNEL_IS_RAW, "HTTP inside a raw tunnel")
        except Denied as denial:
            deny(self.shared, flow, denial)
