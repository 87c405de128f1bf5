"""Identities of the tunnel endpoint's own loopback connections into mitmproxy.

The tunnel endpoint authenticates a Dev CVM, then opens its *own* connection to the proxy from a
loopback (address, port) it bound itself and registers that pair here before connecting. The addon
sees exactly that pair as the client's peername, so the identity comes from the endpoint and
nothing the sandbox sends can set it. An entry lives as long as that one connection.
"""

from __future__ import annotations

import threading

from umbra.proxy.identity import CvmIdentity, IdentitySource


class TunnelIdentities:
    """In-memory (local ip, local port) -> CvmIdentity, written by the tunnel endpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_source: dict[tuple[str, int], CvmIdentity] = {}

    def register(self, host: str, port: int, identity: CvmIdentity) -> None:
        with self._lock:
            if (host, port) in self._by_source:
                raise ValueError("source already registered")
            self._by_source[(host, port)] = identity

    def unregister(self, host: str, port: int) -> None:
        with self._lock:
            self._by_source.pop((host, port), None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_source)

    def by_source(self, host: str, port: int) -> CvmIdentity | None:
        with self._lock:
            return self._by_source.get((host.removeprefix("::ffff:"), port))

    def by_proxy_auth(self, header_value: str) -> CvmIdentity | None:
        return None


class ChainedIdentities:
    """Tunnel connections first (exact source match), then the local identities file."""

    def __init__(self, tunnel: TunnelIdentities, fallback: IdentitySource) -> None:
        self.tunnel = tunnel
        self.fallback = fallback

    def by_source(self, host: str, port: int) -> CvmIdentity | None:
        return self.tunnel.by_source(host, port) or self.fallback.by_source(host, port)

    def by_proxy_auth(self, header_value: str) -> CvmIdentity | None:
        return self.fallback.by_proxy_auth(header_value)
