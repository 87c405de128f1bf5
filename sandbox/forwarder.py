"""The forwarder: the only way out of the sandbox network, TCP only, fail-closed.

For every TCP connection from the sandbox it dials the Security CVM, runs aTLS (a fresh quote
bound to this TLS session, verified against the Security CVM's measurement policy), sends the
identity header, and only then relays bytes. If the Security CVM is down, its quote does not
verify, or anything times out, the sandbox connection is closed and not one of its bytes has
left. Each connection is its own attested session, so a reconnect is always re-verified.

Transparent mode (`transparent.py`): on its sandbox-side :443 and :80 it reads the TLS SNI or the
HTTP `Host` (nothing is sent before attestation), then asks the proxy for `CONNECT name:port` in
the same attested proxy-mode session and replays what it read, so tools that ignore proxy
variables get exactly the proxy's checks. Its one UDP socket is the DNS responder on its
sandbox-side address (`dns_responder.py`), which answers every name with that address and never
sends a query anywhere. It also fetches the Security CVM's interception CA for the sandbox, inside
an attested session like any other (`fetch_ca`, sandbox_ca.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from umbra.attest.atls import ATLSConnection, client_handshake, relay
from umbra.attest.errors import ATLSError, ATLSRefused
from umbra.attest.verify import Verifier
from umbra.contracts.tunnel_header import (
    HeaderError,
    Mode,
    TunnelHeader,
    encode_header,
    read_ca_reply,
    read_env_reply,
)
from umbra.sandbox.dns_responder import DnsResponder
from umbra.sandbox.models import Endpoint, Tunnel
from umbra.sandbox.sandbox_ca import CaBundle, keep_ca_fresh
from umbra.sandbox.sandbox_env_sync import keep_env_fresh
from umbra.sandbox.transparent import (
    MAX_REQUEST_HEAD,
    PEEK_TIMEOUT,
    Refusal,
    Refused,
    connect_request,
    read_client_hello,
    read_connect_reply,
    read_request_head,
)

T = TypeVar("T")
logger = logging.getLogger(__name__)

HALF_CLOSE_GRACE = 60.0
Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Dialer = Callable[[str, int], Awaitable[Streams]]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Peek = Callable[[asyncio.StreamReader], Awaitable[tuple[bytes, str]]]


async def tcp_dial(host: str, port: int) -> Streams:
    return await asyncio.open_connection(host, port)


@dataclass
class ForwarderStats:
    """Counters tests and operators read: what was relayed and what was refused, and why."""

    relayed: int = 0
    active: int = 0  # sandbox connections holding a slot right now
    refused: dict[str, int] = field(default_factory=dict)

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


@dataclass
class Forwarder:
    cvm_id: str
    security_cvm: Endpoint
    verifier: Verifier
    listen_host: str
    proxy_port: int
    tunnels: Sequence[Tunnel] = ()
    credential: str | None = None
    connect_timeout: float = 10.0
    handshake_timeout: float = 30.0
    max_connections: int = 256
    # Where the sandbox's trust in the Security CVM's interception CA comes from (sandbox_ca.py).
    ca_bundle: CaBundle | None = None
    ca_refresh: float = 300.0
    # The sandbox's environment file, kept current with the attached profiles' `sandbox_env`
    # (sandbox_env_sync.py); None: off. `env_base`: this CVM's own values, which come first.
    env_file: Path | None = None
    env_base: dict[str, str] = field(default_factory=dict)
    env_refresh: float = 3.0
    # Transparent listeners on the sandbox-side address: (TLS port, plain HTTP port), each the
    # port the name is connected to at the proxy; None: off. And the DNS responder's port.
    transparent_https: int | None = None
    transparent_http: int | None = None
    dns_port: int | None = None
    dns: DnsResponder | None = None
    peek_timeout: float = PEEK_TIMEOUT
    dial: Dialer = tcp_dial
    # The verification time (None: now); tests of recorded Intel quotes set their collateral's.
    clock: Callable[[], float] | None = None
    stats: ForwarderStats = field(default_factory=ForwarderStats)
    _servers: list[asyncio.Server] = field(default_factory=list)
    _slots: asyncio.Semaphore | None = None

    async def start(self) -> None:
        """Bind every listener; raise OSError (and bind nothing) if one cannot be bound."""
        self._slots = asyncio.Semaphore(self.max_connections)
        # Identity headers are fixed per listener at start: nothing from the sandbox goes in.
        proxy_header = TunnelHeader(self.cvm_id, "proxy", credential=self.credential)
        listeners: list[tuple[int, Handler]] = [(self.proxy_port, self._egress(proxy_header))]
        for t in self.tunnels:
            header = TunnelHeader(
                self.cvm_id, "tunnel", t.name, t.host, t.port, credential=self.credential
            )
            listeners.append((t.listen_port, self._egress(header)))
        # Transparent listeners speak to the proxy as the sandbox would on the proxy port.
        if self.transparent_https is not None:
            listeners.append(
                (self.transparent_https, self._egress(proxy_header, read_client_hello, 443))
            )
        if self.transparent_http is not None:
            listeners.append(
                (self.transparent_http, self._egress(proxy_header, read_request_head, 80))
            )
        try:
            for port, handler in listeners:
                self._servers.append(
                    await asyncio.start_server(
                        handler, self.listen_host, port, limit=MAX_REQUEST_HEAD
                    )
                )
            if self.dns_port is not None:
                self.dns = DnsResponder(self.listen_host, self.dns_port)
                await self.dns.start()
        except OSError:
            await self.close()
            raise

    def ports(self) -> list[int]:
        """Bound ports in listener order (proxy, tunnels...): useful with port 0."""
        return [int(s.sockets[0].getsockname()[1]) for s in self._servers]

    async def close(self) -> None:
        if self.dns is not None:
            await self.dns.close()
        for s in self._servers:
            s.close()
        for s in self._servers:
            with contextlib.suppress(Exception):
                await s.wait_closed()
        self._servers.clear()

    async def serve_forever(self, started: Callable[[], None] | None = None) -> None:
        """`started`: called once every listener is bound (the CLI drops root there)."""
        await self.start()
        if started is not None:
            started()
        tasks = []
        if self.ca_bundle is not None:
            tasks.append(
                asyncio.create_task(keep_ca_fresh(self.fetch_ca, self.ca_bundle, self.ca_refresh))
            )
        if self.env_file is not None:
            tasks.append(
                asyncio.create_task(
                    keep_env_fresh(self.fetch_env, self.env_file, self.env_base, self.env_refresh)
                )
            )
        try:
            await asyncio.Event().wait()
        finally:
            for task in tasks:
                task.cancel()
            await self.close()

    async def fetch_ca(self) -> bytes | None:
        """The Security CVM's interception CA (PEM), read inside an attested session; None (and
        logged) when it cannot be had."""
        return await self._ask("ca", read_ca_reply, "ca_unavailable", "interception CA")

    async def fetch_env(self) -> dict[str, str] | None:
        """The attached profiles' `sandbox_env`, read inside an attested session; None (and
        logged) when it cannot be had."""
        return await self._ask("env", read_env_reply, "env_unavailable", "sandbox environment")

    async def _ask(
        self,
        kind: Mode,
        read: Callable[[Callable[[int], Awaitable[bytes]]], Awaitable[T]],
        refusal: str,
        what: str,
    ) -> T | None:
        """One request of the forwarder's own (`kind`) in a fresh attested session."""
        conn = await self._attest(None)
        if conn is None:
            return None
        try:
            await conn.send(
                encode_header(TunnelHeader(self.cvm_id, kind, credential=self.credential))
            )
            return await asyncio.wait_for(read(conn.recv), self.handshake_timeout)
        except (ATLSError, HeaderError, ConnectionError, OSError, TimeoutError) as exc:
            self.stats.refuse(refusal)
            logger.warning("no %s from the Security CVM: %s", what, exc or type(exc).__name__)
            return None
        finally:
            await conn.close()

    def _egress(self, header: TunnelHeader, peek: Peek | None = None, port: int = 0) -> Handler:
        frame = encode_header(header)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            assert self._slots is not None
            if self._slots.locked():
                self.stats.refuse("too_many_connections")
                await _abort(writer)
                return
            async with self._slots:
                self.stats.active += 1
                try:
                    if peek is None:
                        await self._tunnel(reader, writer, frame)
                    else:
                        await self._transparent(reader, writer, frame, peek, port)
                finally:
                    self.stats.active -= 1

        return handle

    async def _tunnel(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        frame: bytes,
        connect: tuple[bytes, bytes] | None = None,
    ) -> None:
        """Attest, send the identity header, then relay. With `connect` = (CONNECT request, the
        client's bytes already read), first ask the proxy for the tunnel and replay them."""
        conn = await self._attest(writer)
        if conn is None:
            return
        try:
            await conn.send(frame)
            if connect is not None:
                request, replay = connect
                await conn.send(request)
                status, head, rest = await asyncio.wait_for(
                    read_connect_reply(conn.recv), self.handshake_timeout
                )
                if status != 200:
                    # The proxy decided (and recorded) it; say so in the log with its status.
                    raise Refused(
                        Refusal.PROXY_REFUSED, head.split(b"\r\n", 1)[0].decode("ascii", "replace")
                    )
                await conn.send(replay)
                if rest:
                    writer.write(rest)
            self.stats.relayed += 1
            await relay(conn, reader, writer, stream_eof_grace=HALF_CLOSE_GRACE)
        except Refused as refused:
            self.stats.refuse(refused.reason)
            logger.warning("transparent connection refused by the proxy: %s", refused)
        except (ATLSError, ConnectionError, OSError, TimeoutError) as exc:
            logger.info("tunnel ended: %s", exc or type(exc).__name__)
        finally:
            await conn.close()
            await _close(writer)

    async def _transparent(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        frame: bytes,
        peek: Peek,
        port: int,
    ) -> None:
        """A connection to a transparent port: the name from its first bytes (read, never sent
        before attestation), then the proxy-mode session with `CONNECT name:port`."""
        try:
            seen, name = await asyncio.wait_for(peek(reader), self.peek_timeout)
        except (Refused, TimeoutError, ConnectionError, OSError) as exc:
            reason = exc.reason if isinstance(exc, Refused) else Refusal.TIMEOUT
            self.stats.refuse(reason)
            peer = writer.get_extra_info("peername")
            logger.warning(
                "refusing transparent connection from %s to port %d: %s (%s)",
                peer[0] if peer else "?", port, reason, exc or type(exc).__name__,
            )  # fmt: skip
            await _abort(writer)
            return
        logger.info("transparent %s:%d", name, port)
        await self._tunnel(reader, writer, frame, (connect_request(name, port), seen))

    async def _attest(self, client: asyncio.StreamWriter | None) -> ATLSConnection | None:
        """An attested session to the Security CVM, or None after closing `client` (if any)."""
        target = f"{self.security_cvm.host}:{self.security_cvm.port}"
        try:
            up_r, up_w = await asyncio.wait_for(
                self.dial(self.security_cvm.host, self.security_cvm.port), self.connect_timeout
            )
        except (OSError, TimeoutError) as exc:
            self.stats.refuse("security_cvm_unreachable")
            logger.warning(
                "refusing sandbox connection: Security CVM %s unreachable: %s", target, exc
            )
            if client is not None:
                await _abort(client)
            return None
        now = None if self.clock is None else int(self.clock())
        try:
            return await asyncio.wait_for(
                client_handshake(up_r, up_w, self.verifier, now=now), self.handshake_timeout
            )
        except Exception as exc:  # anything unforeseen refuses, never passes
            refusal = exc.collateral_refusal if isinstance(exc, ATLSRefused) else None
            if refusal is not None:
                # The Security CVM's collateral (relayed or fetched) was refused: say which way.
                self.stats.refuse(f"collateral_{refusal}")
                logger.warning(
                    "refusing sandbox connection: Security CVM %s not verified (collateral_%s): %s",
                    target,
                    refusal,
                    exc,
                )
            else:
                self.stats.refuse("attestation_failed")
                logger.warning(
                    "refusing sandbox connection: Security CVM %s not verified: %s",
                    target,
                    str(exc) or type(exc).__name__,
                )
            up_w.close()
            if client is not None:
                await _abort(client)
            return None


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()


async def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST: the sandbox sees a refused connection, never a half-open success."""
    transport = writer.transport
    if isinstance(transport, asyncio.Transport):
        transport.abort()
    else:
        writer.close()
