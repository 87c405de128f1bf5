# mypy: disable-error-code="no-untyped-call"
"""Builds and runs the Security CVM's egress proxy: mitmproxy with exactly the addons Umbra needs.

Used by `umbra proxy serve` and, in-process, by tests (`ProxyThread`). Start-up fails closed: a
policy, bundle, identities or secrets source that does not load stops the proxy with a message
saying which and why, rather than serving with less policy than configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from umbra.policy import BundleError, PolicyError
from umbra.policy.bundle import load_public_key
from umbra.policy.loader import load_policy_dir
from umbra.proxy.config import ProxyConfig
from umbra.proxy.identity import StaticIdentities
from umbra.proxy.netcheck import AddressPolicy, IPAddress, IPNetwork
from umbra.proxy.resolver import OverlayResolver, Resolver, StaticResolver, SystemResolver
from umbra.proxy.secrets import SecretStore
from umbra.proxy.spool import Shipper, Spool
from umbra.proxy.state import PolicyState
from umbra.proxy.tunnel import TunnelEndpoint
from umbra.proxy.tunnel_identities import ChainedIdentities, TunnelIdentities
from umbra.proxy.tunnel_quote import Evidence, EvidenceError, build_evidence

logger = logging.getLogger(__name__)

__all__ = ["ProxyConfig", "ProxyThread", "StartupError", "UmbraProxy", "WorkerSupervisor"]


class StartupError(Exception):
    pass


def _log_to_stderr() -> None:
    """Umbra's own errors (hook failures, refused bundles, failed releases) go to the proxy's
    stderr; mitmproxy's handlers only cover its own loggers."""
    umbra_logger = logging.getLogger("umbra")
    if not umbra_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("umbra %(levelname)s %(name)s: %(message)s"))
        umbra_logger.addHandler(handler)
        umbra_logger.setLevel(logging.INFO)


def _interface_addresses() -> set[IPAddress]:
    """Every address of every local interface (Linux: from /proc), so none of them is dialled."""
    found: set[IPAddress] = set()
    with contextlib.suppress(OSError):
        # fib_trie lists each local IPv4 address as a `/32 host LOCAL` leaf.
        previous = ""
        for line in Path("/proc/net/fib_trie").read_text().splitlines():
            if "/32 host LOCAL" in line and previous:
                with contextlib.suppress(ValueError):
                    found.add(ipaddress.ip_address(previous.split()[-1]))
            previous = line
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            hexaddr = line.split()[0]
            with contextlib.suppress(ValueError):
                found.add(ipaddress.ip_address(int(hexaddr, 16)))
    return found


def _own_addresses(listen_host: str) -> set[IPAddress]:
    found: set[IPAddress] = _interface_addresses()
    candidates = [listen_host, socket.gethostname()]
    for name in candidates:
        with contextlib.suppress(OSError, UnicodeError):
            for info in socket.getaddrinfo(name, None):
                with contextlib.suppress(ValueError):
                    found.add(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]))
    return {address for address in found if not address.is_unspecified}


def config_evidence(config: ProxyConfig, purpose: str) -> Evidence:
    """This TD's quote source (and event log) as the options name them; StartupError if not."""
    try:
        return build_evidence(
            config.quote_source,
            event_log=config.event_log,
            simulated_pki=config.simulated_pki,
            simulated_image=config.simulated_image,
        )
    except EvidenceError as exc:
        raise StartupError(f"{purpose}: {exc}") from None


def console_verify(config: ProxyConfig) -> ssl.SSLContext | bool:
    """TLS trust for the Console: exactly `--console-ca` when given, else the public CAs."""
    if config.console_ca is None:
        return True
    try:
        return ssl.create_default_context(cafile=str(config.console_ca))
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"{config.console_ca}: not a readable CA certificate: {exc}") from None


class UmbraProxy:
    """Everything the proxy runs: mitmproxy master, spool, shipper and policy puller."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.listen_port: int | None = None
        self._ready = threading.Event()
        self._master: object | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.puller: object | None = None
        self.spool: Spool | None = None
        self.state: PolicyState | None = None
        self.identities: StaticIdentities | None = None
        self.tunnel_identities = TunnelIdentities()
        self.tunnel_endpoint: TunnelEndpoint | None = None
        self.tunnel_port: int | None = None
        self._tunnel_server: asyncio.Server | None = None

    def _evidence(self) -> Evidence | None:
        config = self.config
        if config.tunnel_listen_host is None and not config.secrets_from_console:
            return None
        return config_evidence(config, "attestation evidence")

    def _console_client(self) -> httpx.AsyncClient | None:
        """One HTTP client for the Console, carrying this Security CVM's credential."""
        path = self.config.console_credential_file
        if self.config.console_url is None or path is None:
            return None
        try:
            credential = path.read_text().strip()
        except OSError as exc:
            raise StartupError(
                f"{path}: cannot read the Console credential ({exc.strerror})"
            ) from None
        if not credential or any(ord(char) < 0x21 or ord(char) > 0x7E for char in credential):
            raise StartupError(f"{path}: the Console credential must be one printable token")
        return httpx.AsyncClient(
            timeout=10,
            headers={"Authorization": f"Bearer {credential}"},
            verify=console_verify(self.config),
        )

    def _load(self) -> tuple[PolicyState, StaticIdentities, Resolver, AddressPolicy]:
        config = self.config
        try:
            secrets = (
                SecretStore.from_file(config.secrets) if config.secrets else SecretStore.empty()
            )
            identities = StaticIdentities.from_file(config.identities)
            state = PolicyState(secrets)
            if config.policy_dir is not None:
                state.install(policy_set=load_policy_dir(config.policy_dir))
            keys = [load_public_key(path) for path in config.bundle_keys]
            if config.bundle is not None:
                from umbra.proxy.puller import accept_bundle

                state.install(bundle=accept_bundle(config.bundle.read_bytes(), keys, None))
        except (PolicyError, BundleError, OSError) as exc:
            raise StartupError(f"cannot load policy: {exc}") from None
        except Exception as exc:
            raise StartupError(str(exc)) from None
        resolver: Resolver = SystemResolver()
        if config.test_resolver:
            resolver = StaticResolver.from_file(config.test_resolver)
        elif config.test_hosts:
            resolver = OverlayResolver(StaticResolver.from_file(config.test_hosts), resolver)
        allow: list[IPNetwork] = [ipaddress.ip_network(cidr) for cidr in config.test_allow_upstream]
        if allow or config.test_resolver or config.test_hosts:
            print(
                "!" * 78
                + "\nWARNING: TEST-ONLY OPTIONS ACTIVE: "
                + ", ".join(
                    [f"--test-allow-upstream {net}" for net in allow]
                    + (["--test-resolver"] if config.test_resolver else [])
                    + (["--test-hosts"] if config.test_hosts else [])
                )
                + "\nThis proxy may reach addresses a production proxy refuses. Never deploy this.\n"
                + "!" * 78,
                file=sys.stderr,
                flush=True,
            )
        addresses = AddressPolicy(test_allow=tuple(allow))
        return state, identities, resolver, addresses

    async def run(self) -> None:
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

        from umbra.proxy import mitm_compat
        from umbra.proxy.addons import AddonConfig, Shared, build_addons

        mitm_compat.install(reuse_port=self.config.worker_index is not None)
        _log_to_stderr()
        config = self.config
        state, identities, resolver, addresses = self._load()
        evidence = self._evidence()
        self.state, self.identities = state, identities
        spool = Spool(config.spool_dir)
        self.spool = spool
        puller = None
        console_client = self._console_client()
        if config.console_url is not None:
            from umbra.proxy.puller import PolicyPuller

            keys = [load_public_key(path) for path in config.bundle_keys]
            puller = PolicyPuller(
                config.console_url,
                config.security_cvm_id or "",
                keys,
                state,
                identities,
                config.worker_state_dir,
                interval=config.poll_interval,
                client=console_client,
            )
            puller.load_cache()
            self.puller = puller
        config.confdir.mkdir(parents=True, exist_ok=True)
        opts = options.Options()
        master = Master(opts)
        self._master = master
        check = errorcheck.ErrorCheck(repeat_errors_on_stderr=True)
        addon_config = AddonConfig(
            state=state,
            identities=ChainedIdentities(self.tunnel_identities, identities),
            resolver=resolver,
            addresses=addresses,
            spool=spool,
            max_body=config.max_body,
        )
        shared = Shared(addon_config)
        master.addons.add(
            core.Core(),
            disable_h2c.DisableH2C(),
            proxyserver.Proxyserver(),
            next_layer.NextLayer(),
            tlsconfig.TlsConfig(),
            check,
            *build_addons(shared),
        )
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
        opts.update(**updates)
        if puller is not None:
            self._tasks.append(asyncio.create_task(puller.run()))
        if config.secrets_from_console:
            from umbra.proxy.secret_puller import SecretPuller

            assert evidence is not None and console_client is not None  # config validation
            quote_source, event_log = evidence
            secret_puller = SecretPuller(
                config.console_url or "",
                config.security_cvm_id or "",
                quote_source,
                event_log,
                state,
                console_client,
                interval=config.secrets_interval,
            )
            self._tasks.append(asyncio.create_task(secret_puller.run()))
        if config.console_url is not None:
            shipper = Shipper(
                config.spool_dir,
                config.console_url,
                interval=config.ship_interval,
                client=console_client,
            )
            self._tasks.append(asyncio.create_task(shipper.run()))
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            # Stop cleanly so the spool writes every queued record before the process exits.
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(signum, master.shutdown)
        run_task = asyncio.create_task(master.run())
        try:
            ps = master.addons.get("proxyserver")
            for _ in range(600):
                if run_task.done():
                    break
                addrs = ps.listen_addrs() if ps else []
                wanted = 2 if config.worker_index is not None else 1
                if len({int(a[1]) for a in addrs}) >= wanted:
                    ports = {int(a[1]) for a in addrs}
                    port = (
                        config.listen_port if config.worker_index is not None else int(addrs[0][1])
                    )
                    private = min(ports - {port}) if len(ports) > 1 else port
                    self.listen_port = port
                    own = _own_addresses(config.listen_host)
                    listened = {ipaddress.ip_address(str(a[0]).split("%")[0]) for a in addrs}
                    if any(address.is_unspecified for address in listened):
                        # Listening on every interface: every local address is this socket.
                        listened |= own | {
                            ipaddress.ip_address("127.0.0.1"),
                            ipaddress.ip_address("::1"),
                        }
                    own_sockets = [(address, each) for address in listened for each in ports]
                    shared.addresses = addresses.with_own(own, own_sockets)
                    if evidence is not None and config.tunnel_listen_host is not None:
                        try:
                            await self._start_tunnel(evidence, identities, spool, private)
                        except StartupError:
                            master.shutdown()
                            with contextlib.suppress(Exception):
                                await run_task
                            raise
                    # A worker's line differs: only the supervisor announces the whole proxy.
                    who = (
                        "proxy" if config.worker_index is None else f"worker {config.worker_index}"
                    )
                    print(f"umbra {who} listening on {config.listen_host}:{port}", flush=True)
                    self._ready.set()
                    break
                await asyncio.sleep(0.05)
            await run_task
        finally:
            if self._tunnel_server is not None:
                self._tunnel_server.close()
            for task in self._tasks:
                task.cancel()
            spool.close()
            self._ready.set()

    async def _start_tunnel(
        self, evidence: Evidence, identities: StaticIdentities, spool: Spool, proxy_port: int
    ) -> None:
        config = self.config
        assert config.tunnel_listen_host is not None
        endpoint = TunnelEndpoint(
            identities=identities,
            registry=self.tunnel_identities,
            proxy_host=config.listen_host,
            proxy_port=proxy_port,
            emit=spool.append,
            header_timeout=config.tunnel_header_timeout,
            ca_file=config.confdir / "mitmproxy-ca-cert.pem",
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

    def shutdown(self) -> None:
        master = self._master
        if master is not None:
            master.shutdown()  # type: ignore[attr-defined]


class ProxyThread:
    """Runs an UmbraProxy on its own event loop in a background thread (for tests)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.proxy = UmbraProxy(config)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="umbra-proxy", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self.proxy.run())
        except BaseException as exc:
            self._error = exc
            self.proxy._ready.set()

    def start(self, timeout: float = 30) -> int:
        self._thread.start()
        if not self.proxy._ready.wait(timeout) or self.proxy.listen_port is None:
            raise StartupError(f"proxy did not start: {self._error!r}")
        return self.proxy.listen_port

    def stop(self) -> None:
        self.proxy.shutdown()
        self._thread.join(timeout=15)


class WorkerSupervisor:
    """`--workers N`: N proxy processes on one port (SO_REUSEPORT), each pulling policy and
    secrets and spooling on its own. Fails closed: if any worker exits, all are stopped."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._workers: list[subprocess.Popen[bytes]] = []

    def _start(self, index: int) -> subprocess.Popen[bytes]:
        worker = self.config.model_copy(update={"worker_index": index})
        process = subprocess.Popen(
            [sys.executable, "-c", "from umbra.proxy.runner import worker_main; worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert process.stdin is not None
        process.stdin.write(worker.model_dump_json().encode())
        process.stdin.close()
        return process

    def run(self) -> int:
        config = self.config
        ready = threading.Semaphore(0)

        def relay(process: subprocess.Popen[bytes]) -> None:
            assert process.stdout is not None
            for line in process.stdout:
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                if line.startswith(b"umbra worker ") and b" listening on " in line:
                    ready.release()

        stopping = threading.Event()

        def stop(_signum: int, _frame: object) -> None:
            stopping.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stop)
        # Create the interception CA once, before the workers race to create one each.
        from mitmproxy.certs import CertStore

        config.confdir.mkdir(parents=True, exist_ok=True)
        CertStore.from_store(config.confdir, "mitmproxy", 2048)
        try:
            for index in range(config.workers):
                process = self._start(index)
                self._workers.append(process)
                threading.Thread(target=relay, args=(process,), daemon=True).start()
            for _ in range(config.workers):
                while not ready.acquire(timeout=0.2):
                    if stopping.is_set() or any(p.poll() is not None for p in self._workers):
                        raise StartupError("a proxy worker did not start")
            print(
                f"umbra proxy listening on {config.listen_host}:{config.listen_port} "
                f"({config.workers} workers)",
                flush=True,
            )
            while not stopping.is_set():
                if any(p.poll() is not None for p in self._workers):
                    print("umbra proxy: a worker exited; stopping all", file=sys.stderr)
                    return 1
                stopping.wait(0.2)
            return 0
        finally:
            for process in self._workers:
                if process.poll() is None:
                    process.terminate()
            for process in self._workers:
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()


def worker_main() -> None:
    """Entry point of one worker process: its configuration arrives on stdin."""
    config = ProxyConfig.model_validate_json(sys.stdin.buffer.read())
    try:
        asyncio.run(UmbraProxy(config).run())
    except StartupError as exc:
        print(f"umbra proxy worker {config.worker_index}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        pass
