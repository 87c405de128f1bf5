"""TLS 1.3 over asyncio streams with pyOpenSSL memory BIOs.

The stdlib `ssl` module cannot export keying material (RFC 8446 §7.5), which aTLS needs to bind
a quote to one TLS session, so we drive pyOpenSSL ourselves: ciphertext moves between the
socket and the connection's memory BIOs, plaintext through `send`/`recv`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from OpenSSL import SSL

from umbra.attest.errors import ATLSError

_READ_CHUNK = 64 * 1024


def server_context() -> Any:
    """TLS 1.3-only server context with a fresh self-signed certificate.

    The certificate authenticates nothing: the peer trusts the quote bound to the session.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "umbra-atls")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    ctx = SSL.Context(SSL.TLS_METHOD)
    ctx.set_min_proto_version(SSL.TLS1_3_VERSION)
    ctx.use_certificate(cert)
    ctx.use_privatekey(key)
    return ctx


def client_context() -> Any:
    ctx = SSL.Context(SSL.TLS_METHOD)
    ctx.set_min_proto_version(SSL.TLS1_3_VERSION)
    ctx.set_verify(SSL.VERIFY_NONE, lambda *_: True)  # trust comes from the quote, not a CA
    return ctx


class TlsStream:
    def __init__(
        self,
        ctx: Any,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        server: bool,
    ) -> None:
        self._conn = SSL.Connection(ctx, None)
        if server:
            self._conn.set_accept_state()
        else:
            self._conn.set_connect_state()
        self._reader = reader
        self._writer = writer
        self._eof = False

    async def _flush(self) -> None:
        out = b""
        while True:
            try:
                chunk = self._conn.bio_read(_READ_CHUNK)
            except SSL.WantReadError:
                break
            if not chunk:
                break
            out += chunk
        if out:
            self._writer.write(out)
            await self._writer.drain()

    async def _fill(self) -> None:
        data = await self._reader.read(_READ_CHUNK)
        if not data:
            self._eof = True
            self._conn.bio_shutdown()
        else:
            self._conn.bio_write(data)

    async def handshake(self) -> None:
        while True:
            try:
                self._conn.do_handshake()
                break
            except SSL.WantReadError:
                await self._flush()
                if self._eof:
                    raise ATLSError("connection closed during the TLS handshake") from None
                await self._fill()
            except SSL.Error as exc:
                raise ATLSError(f"TLS handshake failed: {exc}") from None
        await self._flush()
        if self._conn.get_protocol_version_name() != "TLSv1.3":
            raise ATLSError(f"negotiated {self._conn.get_protocol_version_name()}, need TLSv1.3")

    def export_keying_material(self, label: bytes, length: int) -> bytes:
        return bytes(self._conn.export_keying_material(label, length, None))

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = self._conn.send(bytes(view[:16384]))
            except SSL.WantReadError:
                await self._flush()
                await self._fill()
                continue
            except SSL.Error as exc:
                raise ATLSError(f"TLS send failed: {exc}") from None
            view = view[n:]
            await self._flush()

    async def recv(self, n: int = _READ_CHUNK) -> bytes:
        """Up to `n` plaintext bytes; b"" at a clean or unclean end of stream."""
        while True:
            try:
                return bytes(self._conn.recv(n))
            except SSL.WantReadError:
                await self._flush()
                if self._eof:
                    return b""
                await self._fill()
            except SSL.ZeroReturnError:
                return b""
            except SSL.SysCallError:
                return b""  # peer vanished without close_notify
            except SSL.Error as exc:
                raise ATLSError(f"TLS receive failed: {exc}") from None

    async def close(self) -> None:
        try:
            self._conn.shutdown()
            await self._flush()
        except (SSL.Error, ConnectionError):
            pass
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()
