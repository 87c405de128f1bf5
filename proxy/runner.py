# mypy: disable-error-code="no-untyped-call"
"""Runs the Security CVM's egress proxy: the lifecycle of one proxy process.

Used by `umbra proxy serve` (one process, or each worker of `proxy/workers.py`). Start-up fails
closed (`startup.py`); then the mitmproxy master (`master.py`) and the background loops
(`background.py`) start, and once the listeners are bound the proxy learns its own sockets (never
dialled), starts the tunnel endpoint on its private port, and announces itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import threading
import time
from typing import TYPE_CHECKING

from umbra.proxy.clock import OffsetClock
from umbra.proxy.config import ProxyConfig
from umbra.proxy.identity import CvmIdentity, StaticIdentities
from umbra.proxy.spool import Spool
from umbra.proxy.startup import (
    StartupError,
    collateral_relay,
    console_client,
    load,
    log_to_stderr,
    tunnel_evidence,
)
from umbra.proxy.state import PolicyState
from umbra.proxy.tunnel import TunnelEndpoint
from umbra.proxy.tunnel_identities import ChainedIdentities, TunnelIdentities
from umbra.proxy.tunnel_quote import Evidence

if TYPE_CHECKING:
    from mitmproxy.master import Master

    from umbra.proxy.addons import Shared
    from umbra.proxy.puller import PolicyPuller

__all__ = ["ProxyConfig", "StartupError", "UmbraProxy"]

# How long the listeners may take to bind (polled every 50 ms).
_LISTEN_POLLS = 600


class UmbraProxy:
    """Everything the proxy runs: mitmproxy master, spool, shipper and policy puller."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.listen_port: int | None = None
        self._ready = threading.Event()
        self._master: Master | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.puller: PolicyPuller | None = None
        self.spool: Spool | None = None
        self.state: PolicyState | None = None
        self.identities: StaticIdentities | None = None
        self.tunnel_identities = TunnelIdentities()
        self.tunnel_endpoint: TunnelEndpoint | None = None
        self.tunnel_port: int | None = None
        self._tunnel_server: asyncio.Server | None = None

    def wait_ready(self, timeout: float) -> bool:
        """Whether the proxy listens (or failed to start) within `timeout` seconds."""
        return self._ready.wait(timeout)

    def mark_ready(self) -> None:
        """Releases `wait_ready` callers, e.g. when the proxy's thread ended with an error."""
        self._ready.set()

    async def run(self) -> None:
        from umbra.proxy import mitm_compat
        from umbra.proxy.addons import AddonConfig, Shared
        from umbra.proxy.background import policy_puller, start_loops
        from umbra.proxy.master import build_master
        from umbra.proxy.minting import minter

        mitm_compat.install(reuse_port=self.config.worker_index is not None)
        log_to_stderr()
        config = self.config
        state, identities, resolver, addresses = load(config)
        evidence = tunnel_evidence(config)
        self.state, self.identities = state, identities
        spool = Spool(config.spool_dir)
        self.spool = spool
        client = console_client(config)
        self.puller = puller = policy_puller(config, state, identities, client)
        config.confdir.mkdir(parents=True, exist_ok=True)
        shared = Shared(
            AddonConfig(
                state=state,
                identities=ChainedIdentities(self.tunnel_identities, identities),
                resolver=resolver,
                addresses=addresses,
                spool=spool,
                max_body=config.max_body,
                minter=minter(config, state, resolver, lambda: shared.addresses, client),
                clock=OffsetClock(config.test_clock) if config.test_clock else time.time,
            )
        )
        self._master = master = build_master(config, shared)
        self._tasks.extend(start_loops(config, state, puller, evidence, client))
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            # Stop cleanly so the spool writes every queued record before the process exits.
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(signum, master.shutdown)
        run_task = asyncio.create_task(master.run())
        try:
            await self._when_listening(master, run_task, shared, evidence, identities)
            await run_task
        finally:
            if self._tunnel_server is not None:
                self._tunnel_server.close()
            for task in self._tasks:
                task.cancel()
            spool.close()
            self._ready.set()

    async def _when_listening(
        self,
        master: Master,
        run_task: asyncio.Task[None],
        shared: Shared,
        evidence: Evidence | None,
        identities: StaticIdentities,
    ) -> None:
        """Waits for the listeners, then tells the dial guard the proxy's own sockets, starts the
        tunnel endpoint on the private port, and announces the proxy."""
        from umbra.proxy.master import listen_addrs
        from umbra.proxy.own_addresses import own_addresses, own_sockets

        config = self.config
        wanted = 2 if config.worker_index is not None else 1
        for _ in range(_LISTEN_POLLS):
            if run_task.done():
                return
            addrs = listen_addrs(master)
            ports = {a[1] for a in addrs}
            if len(ports) >= wanted:
                break
            await asyncio.sleep(0.05)
        else:
            return
        port = config.listen_port if config.worker_index is not None else addrs[0][1]
        private = min(ports - {port}) if len(ports) > 1 else port
        self.listen_port = port
        own = own_addresses(config.listen_host)
        shared.addresses = shared.addresses.with_own(own, own_sockets(addrs, ports, own))
        if evidence is not None and config.tunnel_listen_host is not None:
            try:
                await self._start_tunnel(evidence, identities, shared, private)
            except StartupError:
                master.shutdown()
                with contextlib.suppress(Exception):
                    await run_task
                raise
        # Start-up's objects (mitmproxy, policy, schemas) live as long as the process: out of the
        # collector's reach, a full collection no longer walks them again and again under load.
        gc.freeze()
        # A worker's line differs: only the supervisor announces the whole proxy.
        who = "proxy" if config.worker_index is None else f"worker {config.worker_index}"
        print(f"umbra {who} listening on {config.listen_host}:{port}", flush=True)
        self._ready.set()

    async def _start_tunnel(
        self, evidence: Evidence, identities: StaticIdentities, shared: Shared, proxy_port: int
    ) -> None:
        config = self.config
        assert config.tunnel_listen_host is not None
        endpoint = TunnelEndpoint(
            identities=identities,
            registry=self.tunnel_identities,
            proxy_host=config.listen_host,
            proxy_port=proxy_port,
            emit=shared.traffic.emit,
            header_timeout=config.tunnel_header_timeout,
            ca_file=config.confdir / "mitmproxy-ca-cert.pem",
            sandbox_env=self._sandbox_env,
            collateral=collateral_relay(config),
        )
        quote_source, event_log = evidence
        try:
            server = await endpoint.serve(
                config.tunnel_listen_host, config.tunnel_listen_port, quote_source, event_log
            )
        except OSError as exc:
            raise StartupError(f"tunnel endpoint cannot listen: {exc.strerror}") from None
        self.tunnel_endpoint, self._tunnel_server = endpoint, server
        self.tunnel_port = int(server.sockets[0].getsockname()[1])
        simulated = " (SIMULATED TEE)" if getattr(quote_source, "simulated", False) else ""
        print(
            f"umbra tunnel endpoint listening on {config.tunnel_listen_host}:{self.tunnel_port}"
            + simulated,
            flush=True,
        )

    def _sandbox_env(self, identity: CvmIdentity) -> dict[str, str]:
        """What the sandbox of `identity` gets from its attached profiles (tunnel `env` mode)."""
        if self.state is None:
            return {}
        return dict(self.state.effective(identity).policy.sandbox_env)

    def shutdown(self) -> None:
        if self._master is not None:
            self._master.shutdown()
