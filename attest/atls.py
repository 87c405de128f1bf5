"""Attested TLS: a quote bound to one TLS 1.3 session, exchanged before any application byte.

    client → server  NONCE     32 random bytes
    server → client  EVIDENCE  {"quote": b64, "event_log": dstack JSON | null,
                                "format": "tdx-quote" | "azure-tdx"}
    client → server  VERDICT   {"ok": bool, "reasons": [...], "failures": [{step, reason}]}

Optional **collateral** (`"collateral": <DCAP collateral JSON text>`): a server that relays its
own collateral (`serve_atls(collateral=CollateralRelay(...))`) sends the Intel-signed set for its
quote's platform, so a client that reaches no PCCS can verify it. The set is untrusted bytes: a
client whose verifier takes relayed collateral (`RelayedCollateral`) checks every signature up to
its pinned root before DCAP; any other client ignores the field.

`quote` is whatever the server's `QuoteSource` returns: a bare TDX quote, or on Azure the
evidence envelope of `umbra.attest.azure` (TD quote, HCL report, vTPM quote), which the same
`Verifier.verify` recognises by its magic. `format` and `failures` are informational additions
(older peers ignore them); the bytes alone decide how evidence is verified.

The quote's report_data must equal SHA-512(DOMAIN_TAG ‖ nonce ‖ exporter), where exporter is
the session's RFC 8446 exporter secret. A quote replayed from another session (other nonce,
other exporter) or relayed by a man in the middle (who holds two sessions, with two exporters)
cannot match. Frames are `u32 big-endian length ‖ u8 type ‖ payload`, length capped.

Optional **binding**: a server may commit, per connection, to a short public statement about
what it is about to serve (the SSH ingress binds the host public key it hands sshd). EVIDENCE
then carries `"binding": b64` and report_data = SHA-512(DOMAIN_TAG ‖ nonce ‖ exporter ‖
SHA-256(BINDING_TAG ‖ binding)); without one, the formula above is unchanged, so peers that do
not use bindings (forwarder, tunnel endpoint) see no difference. A client that needs one checks
it with `accept`, before it sends its VERDICT, so a refused binding starts nothing on the server.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from umbra.attest.azure import decode_envelope, is_azure_envelope
from umbra.attest.errors import ATLSError, ATLSRefused, AttestError, EventLogError
from umbra.attest.eventlog import Event, dump_dstack_event_log, parse_dstack_event_log
from umbra.attest.quote_source import QuoteSource
from umbra.attest.tlsstream import TlsStream, client_context, server_context
from umbra.attest.verify import Step, Verdict, Verifier

DOMAIN_TAG = b"umbra-atls-v1\0"
BINDING_TAG = b"umbra-atls-binding-v1\0"
MAX_BINDING = 4096
EXPORTER_LABEL = b"EXPORTER-umbra-atls-v1"
EXPORTER_LEN = 64
NONCE_LEN = 32
MAX_FRAME = 1 << 20  # quotes are ~5 KB; event logs well under 1 MiB
HANDSHAKE_TIMEOUT = 30.0

FRAME_NONCE = 1
FRAME_EVIDENCE = 2
FRAME_VERDICT = 3
_FRAME_NAMES = {FRAME_NONCE: "NONCE", FRAME_EVIDENCE: "EVIDENCE", FRAME_VERDICT: "VERDICT"}


def report_data_for(nonce: bytes, exporter: bytes, binding: bytes | None = None) -> bytes:
    # nonce and exporter have fixed lengths, so the optional 32-byte suffix is unambiguous
    bound = b"" if binding is None else hashlib.sha256(BINDING_TAG + binding).digest()
    return hashlib.sha512(DOMAIN_TAG + nonce + exporter + bound).digest()


# What a client checks about a verified peer beyond the quote: reasons to refuse, or [].
Accept = Callable[[Verdict, bytes | None], list[str]]
# A server's collateral for its own TD quote (JSON bytes), or None when it has none to send.
CollateralProvider = Callable[[bytes], Awaitable[bytes | None]]


def td_quote_of(evidence: bytes) -> bytes:
    """The TD quote in evidence (an Azure envelope carries one): whose collateral to send."""
    return decode_envelope(evidence).td_quote if is_azure_envelope(evidence) else evidence


async def write_frame(tls: TlsStream, kind: int, payload: bytes) -> None:
    await tls.send(struct.pack(">IB", len(payload) + 1, kind) + payload)


class FrameReader:
    def __init__(self, tls: TlsStream, max_frame: int) -> None:
        self.tls = tls
        self.max_frame = max_frame
        self.buf = b""

    async def _exact(self, n: int, what: str) -> bytes:
        while len(self.buf) < n:
            chunk = await self.tls.recv(min(64 * 1024, n - len(self.buf)))
            if not chunk:
                raise ATLSError(
                    f"truncated frame: connection closed after {len(self.buf)} of {n} bytes of {what}"
                )
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    async def read(self, expect: int) -> bytes:
        (length,) = struct.unpack(">I", await self._exact(4, "frame header"))
        if length > self.max_frame:
            raise ATLSError(f"frame of {length} bytes exceeds the {self.max_frame}-byte maximum")
        if length < 1:
            raise ATLSError("empty frame")
        body = await self._exact(length, f"{_FRAME_NAMES.get(expect, '?')} frame")
        if body[0] != expect:
            raise ATLSError(f"expected a {_FRAME_NAMES[expect]} frame, got type {body[0]}")
        return body[1:]

    def leftover(self) -> bytes:
        out, self.buf = self.buf, b""
        return out


@dataclass
class ATLSConnection:
    """An attested session: application bytes flow through `send`/`recv` after the exchange."""

    tls: TlsStream
    verdict: Verdict | None  # client side: the peer's verdict; server side: None
    _pending: bytes = b""
    binding: bytes | None = None  # what the server bound into this session's report_data

    async def send(self, data: bytes) -> None:
        await self.tls.send(data)

    async def recv(self, n: int = 64 * 1024) -> bytes:
        if self._pending:
            out, self._pending = self._pending[:n], self._pending[n:]
            return out
        return await self.tls.recv(n)

    async def close(self) -> None:
        await self.tls.close()


@dataclass(frozen=True)
class _Evidence:
    quote: bytes
    log: list[Event] | None
    binding: bytes | None
    collateral: bytes | None = None


def _decode_evidence(payload: bytes) -> _Evidence:
    try:
        doc = json.loads(payload)
        quote = base64.b64decode(doc["quote"], validate=True)
        log_text = doc.get("event_log")
        raw_binding = doc.get("binding")
        binding = None if raw_binding is None else base64.b64decode(raw_binding, validate=True)
        relayed = doc.get("collateral")
    except (ValueError, KeyError, TypeError, binascii.Error, RecursionError):
        raise ATLSError("EVIDENCE frame is malformed") from None
    if binding is not None and len(binding) > MAX_BINDING:
        raise ATLSError(f"EVIDENCE binding exceeds {MAX_BINDING} bytes")
    if relayed is not None and not isinstance(relayed, str):
        raise ATLSError("EVIDENCE collateral must be a string")
    collateral = None if relayed is None else relayed.encode()
    if log_text is None:
        return _Evidence(quote, None, binding, collateral)
    if not isinstance(log_text, str):
        raise ATLSError("EVIDENCE event_log must be a string")
    try:
        return _Evidence(quote, parse_dstack_event_log(log_text), binding, collateral)
    except EventLogError as exc:
        raise ATLSError(f"EVIDENCE event log is invalid: {exc}") from None


async def client_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    verifier: Verifier,
    *,
    max_frame: int = MAX_FRAME,
    now: int | None = None,
    accept: Accept | None = None,
) -> ATLSConnection:
    """Run TLS 1.3 and the attestation exchange as the client; raise ATLSError if refused.

    `accept` runs on a verified quote, before the VERDICT: its reasons refuse the session."""
    tls = TlsStream(client_context(), reader, writer, server=False)
    try:
        await tls.handshake()
        nonce = os.urandom(NONCE_LEN)
        await write_frame(tls, FRAME_NONCE, nonce)
        frames = FrameReader(tls, max_frame)
        evidence = _decode_evidence(await frames.read(FRAME_EVIDENCE))
        expected = report_data_for(
            nonce, tls.export_keying_material(EXPORTER_LABEL, EXPORTER_LEN), evidence.binding
        )
        verdict = await asyncio.to_thread(
            verifier.verify,
            evidence.quote,
            event_log=evidence.log,
            expected_report_data=expected,
            now=now,
            relayed_collateral=evidence.collateral,
        )
        if verdict.ok and accept is not None:
            for reason in accept(verdict, evidence.binding):
                verdict = verdict.with_failure(Step.BINDING, reason)
        await write_frame(
            tls,
            FRAME_VERDICT,
            json.dumps(
                {
                    "ok": verdict.ok,
                    "reasons": verdict.reasons,
                    "failures": [f.to_json() for f in verdict.failures],
                }
            ).encode(),
        )
        if not verdict.ok:
            raise ATLSRefused(
                "peer attestation refused: " + "; ".join(verdict.reasons),
                verdict.collateral_refusal,
            )
        return ATLSConnection(tls, verdict, frames.leftover(), evidence.binding)
    except BaseException:
        await tls.close()
        raise


async def server_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    quote_source: QuoteSource,
    *,
    event_log: Callable[[], Sequence[Event]] | None = None,
    ctx: Any = None,
    max_frame: int = MAX_FRAME,
    bind: Callable[[], bytes] | None = None,
    collateral: CollateralProvider | None = None,
) -> ATLSConnection:
    """Run TLS 1.3 and the attestation exchange as the attested server.

    `bind`, called once per connection, returns what this session's quote commits to;
    `collateral`, the Intel-signed collateral sent with the quote (None: nothing is sent)."""
    tls = TlsStream(ctx or server_context(), reader, writer, server=True)
    try:
        await tls.handshake()
        frames = FrameReader(tls, max_frame)
        nonce = await frames.read(FRAME_NONCE)
        if len(nonce) != NONCE_LEN:
            raise ATLSError(f"client nonce is {len(nonce)} bytes, expected {NONCE_LEN}")
        try:
            binding = await asyncio.to_thread(bind) if bind is not None else None
        except (OSError, ValueError) as exc:
            raise ATLSError(f"cannot produce the session binding: {exc}") from None
        if binding is not None and len(binding) > MAX_BINDING:
            raise ATLSError(f"the session binding exceeds {MAX_BINDING} bytes")
        rd = report_data_for(
            nonce, tls.export_keying_material(EXPORTER_LABEL, EXPORTER_LEN), binding
        )
        try:
            quote = await asyncio.to_thread(quote_source.get_quote, rd)
        except AttestError as exc:
            raise ATLSError(f"cannot produce a quote: {exc}") from None
        evidence: dict[str, Any] = {
            "quote": base64.b64encode(quote).decode(),
            "event_log": dump_dstack_event_log(event_log()) if event_log else None,
            "format": "azure-tdx" if is_azure_envelope(quote) else "tdx-quote",
        }
        if binding is not None:
            evidence["binding"] = base64.b64encode(binding).decode()
        if collateral is not None:
            try:
                relayed = await collateral(td_quote_of(quote))
                if relayed is not None:
                    evidence["collateral"] = relayed.decode()
            except (AttestError, UnicodeDecodeError):
                pass  # nothing is sent: the client refuses (missing) and says so
        await write_frame(tls, FRAME_EVIDENCE, json.dumps(evidence).encode())
        try:
            result = json.loads(await frames.read(FRAME_VERDICT))
            ok = result["ok"] is True
        except (ValueError, KeyError, TypeError, RecursionError):
            raise ATLSError("VERDICT frame is malformed") from None
        if not ok:
            raise ATLSError(
                "client refused our attestation: "
                + "; ".join(str(r) for r in result.get("reasons", []))
            )
        return ATLSConnection(tls, None, frames.leftover(), binding)
    except BaseException:
        await tls.close()
        raise


async def atls_connect(
    host: str,
    port: int,
    verifier: Verifier,
    *,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    max_frame: int = MAX_FRAME,
    now: int | None = None,
    accept: Accept | None = None,
) -> ATLSConnection:
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port), handshake_timeout
        )
    except (OSError, TimeoutError) as exc:
        raise ATLSError(f"cannot connect to {host}:{port}: {exc}") from None
    try:
        return await asyncio.wait_for(
            client_handshake(reader, writer, verifier, max_frame=max_frame, now=now, accept=accept),
            handshake_timeout,
        )
    except TimeoutError:
        raise ATLSError(f"aTLS handshake with {host}:{port} timed out") from None
    except OSError as exc:
        # Accepted, then reset or closed before anything was attested: a port forward whose
        # service is not listening (yet) looks exactly like this. Still "cannot connect".
        raise ATLSError(
            f"cannot connect to {host}:{port}: the peer reset or closed the connection "
            f"before the aTLS handshake completed ({type(exc).__name__})"
        ) from None


Handler = Callable[[ATLSConnection], Awaitable[None]]


async def serve_atls(
    host: str,
    port: int,
    handler: Handler,
    quote_source: QuoteSource,
    *,
    event_log: Callable[[], Sequence[Event]] | None = None,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    on_error: Callable[[ATLSError], None] | None = None,
    bind: Callable[[], bytes] | None = None,
    collateral: CollateralProvider | None = None,
) -> asyncio.Server:
    """Start an attested server; `handler` runs only for clients that accepted our quote."""
    ctx = server_context()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            conn = await asyncio.wait_for(
                server_handshake(
                    reader,
                    writer,
                    quote_source,
                    event_log=event_log,
                    ctx=ctx,
                    bind=bind,
                    collateral=collateral,
                ),
                handshake_timeout,
            )
        except (ATLSError, TimeoutError, OSError) as exc:
            if on_error is not None:
                on_error(exc if isinstance(exc, ATLSError) else ATLSError(str(exc) or "timeout"))
            return
        try:
            await handler(conn)
        finally:
            await conn.close()

    return await asyncio.start_server(accept, host, port)


RELAY_CHUNK = 64 * 1024


async def relay(
    conn: ATLSConnection,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    stream_eof_grace: float = 0.0,
    peer_eof_grace: float | None = 0.0,
) -> None:
    """Relay bytes between an attested session and a local stream pair until one side ends.

    TLS carries no half-close, so the side that ends first ends the relay, after a grace for the
    other direction to finish: `stream_eof_grace` seconds after the local stream's EOF (a reply
    still on its way from the peer), `peer_eof_grace` after the peer's (the stream is given EOF;
    None waits until the stream ends). Transport errors end the relay; the caller closes both ends.
    """

    async def to_peer() -> None:
        while data := await reader.read(RELAY_CHUNK):
            await conn.send(data)

    async def to_stream() -> None:
        while data := await conn.recv(RELAY_CHUNK):
            writer.write(data)
            await writer.drain()
        if peer_eof_grace != 0 and writer.can_write_eof():
            writer.write_eof()

    up = asyncio.ensure_future(to_peer())
    down = asyncio.ensure_future(to_stream())
    try:
        done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        first = up if up in done else down
        if len(done) == 1 and first.exception() is None:
            other, grace = (down, stream_eof_grace) if first is up else (up, peer_eof_grace)
            if grace is None or grace > 0:
                await asyncio.wait({other}, timeout=grace)
    except (ConnectionError, OSError, ATLSError):
        pass
    finally:
        for task in (up, down):
            task.cancel()
        for task in (up, down):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
