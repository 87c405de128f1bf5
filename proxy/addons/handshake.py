"""Handshake: the upstream TLS ClientHello carries only what the proxy chose, never sandbox bytes.

mitmproxy copies the client's ALPN offers verbatim into the upstream ClientHello (and, in
transparent mode, the client's SNI): any string the sandbox offers as a protocol name would reach
the origin unscanned. Before each upstream connection is opened, the offers are set to the
protocols the proxy itself speaks upstream, in the proxy's own order, limited to those the client
offered (so both legs speak the same HTTP version; a client offering neither gets `http/1.1`),
and the SNI to the normalized connect host. Every other ClientHello field (cipher list, versions,
curves, extensions) is mitmproxy's own configuration, never copied from the client.
"""

from __future__ import annotations

from collections.abc import Sequence

from mitmproxy.proxy import server_hooks

from umbra.policy import normalize_host
from umbra.proxy.addons.base import UmbraAddon, guard

# What the proxy speaks upstream, in its order of preference.
UPSTREAM_ALPN: tuple[bytes, ...] = (b"h2", b"http/1.1")


def upstream_alpn(client_offers: Sequence[bytes]) -> tuple[bytes, ...]:
    offered = set(client_offers)
    return tuple(proto for proto in UPSTREAM_ALPN if proto in offered) or (b"http/1.1",)


class Handshake(UmbraAddon):
    @guard
    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        server = data.server
        if not server.tls:
            return
        # Never empty: mitmproxy copies the client's offers into an empty list.
        server.alpn_offers = upstream_alpn(data.client.alpn_offers)
        if server.address is not None:
            state = self.shared.conns.get(data.client)
            server.sni = state.connect_host or normalize_host(str(server.address[0]))
