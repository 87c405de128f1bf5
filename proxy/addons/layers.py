# mypy: disable-error-code="no-untyped-call"
"""Layers: only HTTP(S) and WebSocket, or raw TCP for an explicit tunnel rule; no UDP/QUIC."""

from __future__ import annotations

from mitmproxy import tcp, tls, udp
from mitmproxy.proxy import layer, layers
from mitmproxy.proxy.layers.http import HTTPMode

from umbra.proxy.addons.base import UmbraAddon, guard


class Layers(UmbraAddon):
    @guard
    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        state = self.shared.conns.get(nextlayer.context.client)
        if state.tunnel_rule is not None and state.connect_host is not None:
            nextlayer.layer = layers.TCPLayer(nextlayer.context)
            return
        chosen = nextlayer.layer
        if isinstance(chosen, (layers.TCPLayer, layers.UDPLayer, layers.DNSLayer)) or (
            type(chosen).__name__ in ("RawQuicLayer", "ServerQuicLayer", "ClientQuicLayer")
        ):
            # No raw TCP, UDP, DNS or QUIC except an explicit tunnel: parse it as HTTP instead,
            # which fails for anything that is not HTTP.
            nextlayer.layer = layers.HttpLayer(nextlayer.context, HTTPMode.transparent)

    @guard
    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        data.ignore_connection = False
        data.establish_server_tls_first = False

    @guard
    def tcp_start(self, flow: tcp.TCPFlow) -> None:
        state = self.shared.conns.get(flow.client_conn)
        if state.tunnel_rule is None or state.poisoned:
            # kill() alone does not stop mitmproxy's TCP layer: poisoning makes the dial guard
            # refuse the upstream connection, which closes the client side too.
            state.poisoned = state.poisoned or "raw TCP without a tunnel rule"
            flow.kill()

    @guard
    def tcp_message(self, flow: tcp.TCPFlow) -> None:
        state = self.shared.conns.get(flow.client_conn)
        if state.poisoned or state.tunnel_rule is None:
            flow.messages[-1].content = b""
            flow.kill()

    @guard
    def udp_start(self, flow: udp.UDPFlow) -> None:
        flow.kill()
