"""The tunnel endpoint: where Dev CVM forwarders' aTLS sessions enter the Security CVM.

Per session: aTLS (we are the attested side), then the identity header (`contracts.tunnel_header`),
then the CVM is checked (known, attached, credential matches). Only then the endpoint opens its
own loopback connection to the proxy, from a source (address, port) it registered for that CVM in
`TunnelIdentities` before connecting; the addon attributes the connection by that source alone.
In `tunnel` mode the endpoint itself sends `CONNECT host:port` for the configured destination, so
the addon's tunnel-rule decision and logging apply unchanged. Any failure closes the session with
a traffic-log record (kind `connection`, reason `tunnel_*`); no sandbox byte reaches the proxy.
Records go through the proxy's one record builder (`emit` is the traffic-log addon's
`TrafficLog.emit`), so they are redacted like every other record: a claimed cvm_id is sandbox text.

aTLS is one-way (the forwarder verifies us), so the per-CVM credential is what authenticates the
Dev CVM until mutual attestation exists.

A `ca` header (same checks) is answered with the interception CA certificate instead of a relay:
the forwarder installs it for its sandbox, authenticated by this attested session.

With `collateral` (a `CollateralRelay`), every EVIDENCE frame carries the Intel-signed collateral
for our own quote, fetched through this CVM's egress and renewed before it lapses: a cloud Dev
CVM's forwarder reaches no PCCS, and needs no new route for this (attest/atls.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from umbra.attest.atls import ATLSConnection, CollateralProvider, relay, serve_atls
from umbra.attest.errors import ATLSError
from umbra.attest.eventlog import Event
from umbra.attest.quote_source import QuoteSource
from umbra.contracts.traffic import Decision, Kind
from umbra.contracts.tunnel_header import (
    HeaderClosed,
    HeaderError,
    HeaderTooLarge,
    TunnelHeader,
    encode_ca_reply,
    encode_env_reply,
    read_header,
)
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.identity import CvmIdentity, StaticIdentities
from umbra.proxy.tunnel_identities import TunnelIdentities

logger = logging.getLogger(__name__)

MAX_CONNECT_RESPONSE = 8192


@dataclass
class EndpointStats:
    accepted: int = 0
    ca_served: int = 0
    env_served: int = 0
    refused: dict[str, int] = field(default_factory=dict)


@dataclass
class TunnelEndpoint:
    identities: StaticIdentities
    registry: TunnelIdentities
    proxy_host: str  # the proxy's loopback listener
    proxy_port: int
    # The traffic log's record builder: redacts the fields, builds the record, spools it.
    emit: Callable[[dict[str, Any]], None]
    header_timeout: float = 10.0
    connect_timeout: float = 10.0
    # The interception CA's certificate (mitmproxy's `mitmproxy-ca-cert.pem`): never the key.
    ca_file: Path | None = None
    # The composed `sandbox_env` of the profiles attached to a CVM now (`env` mode); None: an
    # endpoint without policy (tests) answers every CVM with an empty environment.
    sandbox_env: Callable[[CvmIdentity], dict[str, str]] | None = None
    # The collateral for our own quote, sent with it (`--tunnel-collateral-pccs`: a
    # `CollateralRelay`); None: forwarders fetch their own from a PCCS.
    collateral: CollateralProvider | None = None
    stats: EndpointStats = field(default_factory=EndpointStats)

    async def serve(
        self,
        host: str,
        port: int,
        quote_source: QuoteSource,
        event_log: Callable[[], Sequence[Event]] | None = None,
        handshake_timeout: float = 30.0,
    ) -> asyncio.Server:
        return await serve_atls(
            host,
            port,
            self.handle,
            quote_source,
            event_log=event_log,
            handshake_timeout=handshake_timeout,
            on_error=self._atls_failed,
            collateral=self.collateral,
        )

    def _refuse(self, reason: Reason, detail: str, identity: CvmIdentity | None = None) -> None:
        self.stats.refused[reason] = self.stats.refused.get(reason, 0) + 1
        logger.warning("tunnel refused: %s", reason)
        self.emit(
            {
                "kind": Kind.CONNECTION,
                "cvm_id": identity.cvm_id if identity else None,
                "owner": identity.owner if identity else None,
                "team": identity.team if identity else None,
                "decision": Decision.DENY,
                "reason": reason,
                "detail": detail[:300],
            }
        )

    def _atls_failed(self, exc: ATLSError) -> None:
        # The message may describe the peer's bytes; only say that the handshake failed.
        self._refuse(Reason.TUNNEL_ATLS_FAILED, "aTLS handshake failed or timed out")

    async def handle(self, conn: ATLSConnection) -> None:
        try:
            header, rest = await asyncio.wait_for(read_header(conn.recv), self.header_timeout)
        except TimeoutError:
            return self._refuse(Reason.TUNNEL_HEADER_TIMEOUT, "no identity header in time")
        except HeaderTooLarge as exc:
            return self._refuse(Reason.TUNNEL_HEADER_TOO_LARGE, str(exc))
        except (HeaderClosed, ATLSError, ConnectionError, OSError):
            return self._refuse(Reason.TUNNEL_CLOSED, "session ended before the identity header")
        except HeaderError:
            # Not the parser's message: it may quote what the client sent.
            return self._refuse(Reason.TUNNEL_MALFORMED_HEADER, "header fields are invalid")
        claimed = f"claimed cvm_id {header.cvm_id}"
        identity = self.identities.lookup(header.cvm_id)
        if identity is None:
            return self._refuse(Reason.TUNNEL_UNKNOWN_CVM, claimed)
        if header.credential is None:
            return self._refuse(Reason.TUNNEL_MISSING_CREDENTIAL, claimed)
        if not self.identities.credential_matches(header.cvm_id, header.credential):
            return self._refuse(Reason.TUNNEL_BAD_CREDENTIAL, claimed)
        try:
            if header.mode == "ca":
                await self._send_ca(conn, identity)
            elif header.mode == "env":
                await self._send_env(conn, identity)
            else:
                await self._relay(conn, header, identity, rest)
        except (ATLSError, ConnectionError, OSError) as exc:
            logger.info("tunnel of %s ended: %s", identity.cvm_id, type(exc).__name__)

    async def _send_ca(self, conn: ATLSConnection, identity: CvmIdentity) -> None:
        try:
            if self.ca_file is None:
                raise OSError("no CA configured")
            reply = encode_ca_reply(self.ca_file.read_bytes())
        except (OSError, HeaderError):
            return self._refuse(
                Reason.TUNNEL_NO_CA, "the interception CA cannot be served", identity
            )
        await conn.send(reply)
        self.stats.ca_served += 1

    async def _send_env(self, conn: ATLSConnection, identity: CvmIdentity) -> None:
        try:
            env = self.sandbox_env(identity) if self.sandbox_env is not None else {}
            reply = encode_env_reply(env)
        except HeaderError:
            return self._refuse(
                Reason.TUNNEL_NO_ENV, "the sandbox environment cannot be served", identity
            )
        await conn.send(reply)
        self.stats.env_served += 1

    async def _relay(
        self, conn: ATLSConnection, header: TunnelHeader, identity: CvmIdentity, rest: bytes
    ) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.proxy_host else socket.AF_INET)
        sock.setblocking(False)
        registered: tuple[str, int] | None = None
        writer: asyncio.StreamWriter | None = None
        try:
            try:
                # Register the source before connecting: the addon looks it up on accept.
                sock.bind((self.proxy_host, 0))
                local = sock.getsockname()
                registered = (str(local[0]), int(local[1]))
                self.registry.register(*registered, identity)
                await asyncio.wait_for(
                    asyncio.get_running_loop().sock_connect(
                        sock, (self.proxy_host, self.proxy_port)
                    ),
                    self.connect_timeout,
                )
                reader, writer = await asyncio.open_connection(sock=sock)
            except (OSError, TimeoutError, ValueError):
                return self._refuse(Reason.TUNNEL_PROXY_UNREACHABLE, "", identity)
            if header.mode == "tunnel":
                assert header.host is not None and header.port is not None
                if not await _connect(reader, writer, header.host, header.port):
                    # The addon decided and logged; the sandbox sees the session close.
                    return
            self.stats.accepted += 1
            if rest:
                writer.write(rest)
            await relay(conn, reader, writer)
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
            else:
                sock.close()
            if registered is not None:
                self.registry.unregister(*registered)


async def _connect(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int
) -> bool:
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    await writer.drain()
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
        return False
    if len(head) > MAX_CONNECT_RESPONSE:
        return False
    status_line = head.split(b"\r\n", 1)[0].split()
    return len(status_line) >= 2 and status_line[1] == b"200"
