"""aTLS over real TLS 1.3 on loopback: the honest session and each way to cheat it."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from umbra.attest.atls import (
    EXPORTER_LABEL,
    EXPORTER_LEN,
    FRAME_EVIDENCE,
    FRAME_NONCE,
    MAX_FRAME,
    ATLSConnection,
    FrameReader,
    atls_connect,
    report_data_for,
    serve_atls,
    write_frame,
)
from umbra.attest.collateral import Collateral, StaticCollateral
from umbra.attest.errors import ATLSError
from umbra.attest.eventlog import dump_dstack_event_log
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.quote_source import SimulatedSource
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.tlsstream import TlsStream, client_context, server_context
from umbra.attest.verify import Verifier

from .conftest import T_SIM

COMPOSE = bytes(range(32))


@pytest.fixture
def attested(pki: SimulatedPki) -> SimulatedTdx:
    tdx = SimulatedTdx(pki)
    tdx.extend_runtime_event("compose-hash", COMPOSE)
    return tdx


@pytest.fixture
def verifier(pki: SimulatedPki, sim_collateral: Collateral, attested: SimulatedTdx) -> Verifier:
    policy = MeasurementPolicy(
        release=attested.release_manifest(
            events=[{"name": "compose-hash", "payloads": [COMPOSE.hex()]}]
        )
    )
    return Verifier(
        policy,
        StaticCollateral(sim_collateral),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )


async def _echo(conn: ATLSConnection) -> None:
    data = await conn.recv()
    await conn.send(b"echo:" + data)


@asynccontextmanager
async def honest_server(
    tdx: SimulatedTdx, errors: list[ATLSError] | None = None
) -> AsyncIterator[int]:
    server = await serve_atls(
        "127.0.0.1",
        0,
        _echo,
        SimulatedSource(tdx),
        event_log=tdx.event_log,
        on_error=None if errors is None else errors.append,
    )
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


Behaviour = Callable[[TlsStream, FrameReader], Awaitable[None]]


@asynccontextmanager
async def rogue_server(behaviour: Behaviour) -> AsyncIterator[int]:
    """A TLS 1.3 server that runs `behaviour` instead of the honest protocol."""
    ctx = server_context()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tls = TlsStream(ctx, reader, writer, server=True)
        try:
            await tls.handshake()
            await behaviour(tls, FrameReader(tls, MAX_FRAME))
        except ATLSError:
            pass
        finally:
            await tls.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def _evidence(quote: bytes, tdx: SimulatedTdx) -> bytes:
    return json.dumps(
        {
            "quote": base64.b64encode(quote).decode(),
            "event_log": dump_dstack_event_log(tdx.event_log()),
        }
    ).encode()


async def test_honest_session(attested: SimulatedTdx, verifier: Verifier) -> None:
    async with honest_server(attested) as port:
        conn = await atls_connect("127.0.0.1", port, verifier, now=T_SIM)
        assert conn.verdict is not None
        assert conn.verdict.ok
        assert conn.verdict.simulated
        assert conn.verdict.events_checked == ["compose-hash"]
        await conn.send(b"hello")
        assert await conn.recv() == b"echo:hello"
        await conn.close()


async def test_refusing_client_is_reported_to_server(
    attested: SimulatedTdx, verifier: Verifier
) -> None:
    errors: list[ATLSError] = []
    async with honest_server(attested, errors) as port:
        with pytest.raises(ATLSError, match="peer attestation refused"):
            await atls_connect("127.0.0.1", port, verifier, now=T_SIM + 40 * 86400)
        for _ in range(100):
            if errors:
                break
            await asyncio.sleep(0.01)
    assert errors
    assert "client refused our attestation" in str(errors[0])


async def test_wrong_nonce(attested: SimulatedTdx, verifier: Verifier) -> None:
    async def behaviour(tls: TlsStream, frames: FrameReader) -> None:
        await frames.read(FRAME_NONCE)
        exporter = tls.export_keying_material(EXPORTER_LABEL, EXPORTER_LEN)
        quote = attested.quote(report_data_for(os.urandom(32), exporter))
        await write_frame(tls, FRAME_EVIDENCE, _evidence(quote, attested))
        await tls.recv()

    async with rogue_server(behaviour) as port:
        with pytest.raises(ATLSError, match="report_data does not match"):
            await atls_connect("127.0.0.1", port, verifier, now=T_SIM)


async def test_replayed_quote(attested: SimulatedTdx, verifier: Verifier) -> None:
    recorded: list[bytes] = []

    class Recorder(SimulatedSource):
        def get_quote(self, report_data: bytes) -> bytes:
            q = super().get_quote(report_data)
            recorded.append(q)
            return q

    server = await serve_atls(
        "127.0.0.1", 0, _echo, Recorder(attested), event_log=attested.event_log
    )
    port = server.sockets[0].getsockname()[1]
    conn = await atls_connect("127.0.0.1", port, verifier, now=T_SIM)
    await conn.close()
    server.close()
    await server.wait_closed()
    assert len(recorded) == 1

    async def behaviour(tls: TlsStream, frames: FrameReader) -> None:
        await frames.read(FRAME_NONCE)
        await write_frame(tls, FRAME_EVIDENCE, _evidence(recorded[0], attested))
        await tls.recv()

    async with rogue_server(behaviour) as port:
        with pytest.raises(ATLSError, match="report_data does not match"):
            await atls_connect("127.0.0.1", port, verifier, now=T_SIM)


async def test_exporter_from_another_session(attested: SimulatedTdx, verifier: Verifier) -> None:
    """A relay: it forwards the client's nonce to a genuine TD over its own TLS session, and
    the genuine quote it gets back is bound to that other session's exporter."""
    async with honest_server(attested) as genuine_port:

        async def relay(tls: TlsStream, frames: FrameReader) -> None:
            nonce = await frames.read(FRAME_NONCE)
            reader, writer = await asyncio.open_connection("127.0.0.1", genuine_port)
            upstream = TlsStream(client_context(), reader, writer, server=False)
            await upstream.handshake()
            await write_frame(upstream, FRAME_NONCE, nonce)
            evidence = await FrameReader(upstream, MAX_FRAME).read(FRAME_EVIDENCE)
            await write_frame(tls, FRAME_EVIDENCE, evidence)
            await tls.recv()
            await upstream.close()

        async with rogue_server(relay) as port:
            with pytest.raises(ATLSError, match="report_data does not match"):
                await atls_connect("127.0.0.1", port, verifier, now=T_SIM)


async def test_oversized_frame(verifier: Verifier) -> None:
    async def behaviour(tls: TlsStream, frames: FrameReader) -> None:
        await frames.read(FRAME_NONCE)
        await tls.send(struct.pack(">IB", MAX_FRAME + 1, FRAME_EVIDENCE))
        await tls.recv()

    async with rogue_server(behaviour) as port:
        with pytest.raises(ATLSError, match=f"exceeds the {MAX_FRAME}-byte maximum"):
            await atls_connect("127.0.0.1", port, verifier, now=T_SIM)


async def test_truncated_frame(verifier: Verifier) -> None:
    async def behaviour(tls: TlsStream, frames: FrameReader) -> None:
        await frames.read(FRAME_NONCE)
        await tls.send(struct.pack(">IB", 100, FRAME_EVIDENCE) + b"x" * 10)
        # returning closes the TLS session mid-frame

    async with rogue_server(behaviour) as port:
        with pytest.raises(ATLSError, match="truncated frame"):
            await atls_connect("127.0.0.1", port, verifier, now=T_SIM)


async def test_server_refuses_oversized_client_frame(attested: SimulatedTdx) -> None:
    errors: list[ATLSError] = []
    async with honest_server(attested, errors) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        tls = TlsStream(client_context(), reader, writer, server=False)
        await tls.handshake()
        await tls.send(struct.pack(">IB", MAX_FRAME + 5, FRAME_NONCE))
        assert await tls.recv() == b""
        await tls.close()
    assert errors
    assert "exceeds" in str(errors[0])


async def test_plain_tcp_peer_is_not_tls(verifier: Verifier) -> None:
    async def not_tls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n" * 4)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(not_tls, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(ATLSError, match="TLS handshake"):
            await atls_connect("127.0.0.1", port, verifier, now=T_SIM)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_peer_that_resets_before_the_handshake_is_an_atls_error(
    verifier: Verifier,
) -> None:
    """What a QEMU port forward does while nothing in the guest listens yet: accept, then
    reset. One error family (ATLSError, "cannot connect"), never a bare ConnectionResetError
    (`umbra ssh` said `internal: ConnectionResetError` for an ingress still starting)."""
    import socket

    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await reader.read(1)  # the ClientHello has arrived: the reset lands mid-handshake
        writer.transport.abort()

    server = await asyncio.start_server(reset, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(ATLSError, match=f"cannot connect to 127.0.0.1:{port}: .*reset"):
            await atls_connect("127.0.0.1", port, verifier, now=T_SIM)
    finally:
        server.close()
        await server.wait_closed()


async def test_azure_evidence_over_atls(pki: SimulatedPki, sim_collateral: Collateral) -> None:
    """The same client and server, an Azure quote source: the exporter binding goes through the
    vTPM's user-data and the vTPM quote's nonce."""
    from umbra.attest.simazure import SimulatedAzureCvm

    cvm = SimulatedAzureCvm(pki)
    verifier = Verifier(
        MeasurementPolicy(release=cvm.release_manifest()),
        StaticCollateral(sim_collateral),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    server = await serve_atls("127.0.0.1", 0, _echo, cvm.source())
    port = server.sockets[0].getsockname()[1]
    try:
        conn = await atls_connect("127.0.0.1", port, verifier, now=T_SIM)
        assert conn.verdict is not None and conn.verdict.ok, conn.verdict
        assert conn.verdict.platform == "azure-tdx"
        await conn.send(b"hi")
        assert await conn.recv() == b"echo:hi"
        await conn.close()
    finally:
        server.close()
        await server.wait_closed()

    async def replay(tls: TlsStream, frames: FrameReader) -> None:
        await frames.read(FRAME_NONCE)
        stale = cvm.source().get_quote(os.urandom(64))  # not this session's binding
        doc = {"quote": base64.b64encode(stale).decode(), "event_log": None}
        await write_frame(tls, FRAME_EVIDENCE, json.dumps(doc).encode())
        await tls.recv()

    async with rogue_server(replay) as port:
        with pytest.raises(ATLSError, match="user-data does not match"):
            await atls_connect("127.0.0.1", port, verifier, now=T_SIM)


async def test_a_binding_is_committed_to_and_checked_before_the_verdict(
    attested: SimulatedTdx, verifier: Verifier
) -> None:
    """The server binds a statement per connection; the client sees it and may refuse it before
    its VERDICT, so the server's handler never runs."""
    ran: list[bytes | None] = []
    errors: list[ATLSError] = []

    async def handler(conn: ATLSConnection) -> None:
        ran.append(conn.binding)

    server = await serve_atls(
        "127.0.0.1",
        0,
        handler,
        SimulatedSource(attested),
        event_log=attested.event_log,
        on_error=errors.append,
        bind=lambda: b"ssh-ed25519 AAAA-key-1",
    )
    port = server.sockets[0].getsockname()[1]
    try:
        conn = await atls_connect("127.0.0.1", port, verifier, now=T_SIM)
        assert conn.binding == b"ssh-ed25519 AAAA-key-1"
        await conn.close()
        for _ in range(100):
            if ran:
                break
            await asyncio.sleep(0.01)
        assert ran == [b"ssh-ed25519 AAAA-key-1"]
        with pytest.raises(ATLSError, match="binding: not the key we expect"):
            await atls_connect(
                "127.0.0.1", port, verifier, now=T_SIM,
                accept=lambda _v, binding: ["binding: not the key we expect"],
            )  # fmt: skip
        for _ in range(100):
            if errors:
                break
            await asyncio.sleep(0.01)
        assert "not the key we expect" in str(errors[0])
        assert len(ran) == 1  # the refused session never reached the handler
    finally:
        server.close()
        await server.wait_closed()


async def test_a_binding_swapped_in_transit_breaks_the_report_data(
    attested: SimulatedTdx, verifier: Verifier
) -> None:
    """A quote bound to binding A cannot be presented with binding B (nor with none)."""

    def rogue(sent: bytes | None) -> Behaviour:
        async def behaviour(tls: TlsStream, frames: FrameReader) -> None:
            nonce = await frames.read(FRAME_NONCE)
            exporter = tls.export_keying_material(EXPORTER_LABEL, EXPORTER_LEN)
            quote = attested.quote(report_data_for(nonce, exporter, b"key-A"))
            doc = json.loads(_evidence(quote, attested))
            if sent is not None:
                doc["binding"] = base64.b64encode(sent).decode()
            await write_frame(tls, FRAME_EVIDENCE, json.dumps(doc).encode())
            await tls.recv()

        return behaviour

    for sent in (b"key-B", None):
        async with rogue_server(rogue(sent)) as port:
            with pytest.raises(ATLSError, match="report_data does not match"):
                await atls_connect("127.0.0.1", port, verifier, now=T_SIM)
    # and without a binding the formula is the one every other aTLS user keeps
    assert report_data_for(b"n" * 32, b"e" * 64) == report_data_for(b"n" * 32, b"e" * 64, None)
    assert report_data_for(b"n" * 32, b"e" * 64) != report_data_for(b"n" * 32, b"e" * 64, b"")
