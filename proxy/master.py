# mypy: disable-error-code="no-untyped-call"
"""The mitmproxy master Umbra runs: exactly mitmproxy's core addons plus Umbra's, and the
mitmproxy options, declared once here. Internals mitmproxy does not expose are reached only by
`mitm_compat`; this module uses its public API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from umbra.proxy.config import ProxyConfig

if TYPE_CHECKING:
    from mitmproxy.master import Master

    from umbra.proxy.addons import Shared


def option_updates(config: ProxyConfig) -> dict[str, object]:
    """mitmproxy's options for this proxy: no bypass (every host intercepted, no raw TCP or UDP,
    no HTTP/3), upstream certificates verified, request bodies limited."""
    updates: dict[str, object] = {
        "mode": ["regular"],
        "listen_host": config.listen_host,
        "listen_port": config.listen_port,
        "confdir": str(config.confdir),
        "connection_strategy": "lazy",
        "rawtcp": False,
        "http3": False,
        "ignore_hosts": [],
        "allow_hosts": [],
        "tcp_hosts": [],
        "udp_hosts": [],
        "body_size_limit": str(config.max_body),
        "stream_large_bodies": None,
        "upstream_cert": False,
        "validate_inbound_headers": True,
        "websocket": True,
        "http2": True,
        "ssl_insecure": False,
    }
    if config.upstream_ca is not None:
        updates["ssl_verify_upstream_trusted_ca"] = str(config.upstream_ca)
    if config.worker_index is not None:
        # The shared port (SO_REUSEPORT: the kernel spreads connections over the workers) and a
        # private loopback port only this worker's tunnel endpoint uses, so a tunnel's
        # registered identity and its proxied connection are always in the same process.
        host = f"[{config.listen_host}]" if ":" in config.listen_host else config.listen_host
        updates["mode"] = [f"regular@{host}:{config.listen_port}", "regular@127.0.0.1:0"]
    return updates


def build_master(config: ProxyConfig, shared: Shared) -> Master:
    """A master with mitmproxy's core addons, Umbra's addons (behind one `Chain`), and
    `option_updates` applied."""
    from mitmproxy import options
    from mitmproxy.addons import (
        core,
        disable_h2c,
        errorcheck,
        next_layer,
        proxyserver,
        tlsconfig,
    )
    from mitmproxy.master import Master

    from umbra.proxy.addons import build_addons
    from umbra.proxy.addons.chain import Chain

    opts = options.Options()
    master = Master(opts)
    master.addons.add(
        core.Core(),
        disable_h2c.DisableH2C(),
        proxyserver.Proxyserver(),
        next_layer.NextLayer(),
        tlsconfig.TlsConfig(),
        errorcheck.ErrorCheck(repeat_errors_on_stderr=True),
        # One entry for mitmproxy; the per-concern addons run behind it in the registry's order.
        Chain(build_addons(shared)),
    )
    opts.update(**option_updates(config))
    return master


def listen_addrs(master: Master) -> list[tuple[str, int]]:
    """The (host, port) mitmproxy's listeners are bound to (empty until they are)."""
    server = master.addons.get("proxyserver")
    return [(str(a[0]), int(a[1])) for a in server.listen_addrs()] if server else []
