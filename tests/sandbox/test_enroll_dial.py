"""A cloud Dev CVM has no DNS: its forwarder dials the Console's address from launch data while
TLS still verifies the Console's name (SNI, certificate, Host). A real TLS server on loopback whose
certificate also carries 127.0.0.1 as an IP SAN, so only a check against the name can refuse it."""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.proxy.harness import TestCA as OriginCA
from umbra.attest.enroll_client import EnrollError, ensure_credential

seen: list[tuple[str | None, str | None]] = []


class _Challenge(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        seen.append((getattr(self.connection, "umbra_sni", None), self.headers.get("Host")))
        body = json.dumps({"nonce": ""}).encode()  # answered, but no nonce: stops the client
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _serve(ca: OriginCA, name: str) -> Iterator[int]:
    cert, key = ca.issue([name])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)

    def remember(sock: ssl.SSLObject | ssl.SSLSocket, sni: str | None, _ctx: object) -> None:
        sock.umbra_sni = sni  # type: ignore[union-attr]

    ctx.sni_callback = remember  # type: ignore[assignment]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Challenge)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def ca(tmp_path: Path) -> OriginCA:
    return OriginCA(tmp_path)


def _dial(tmp_path: Path, ca: OriginCA, port: int) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 32)
    ensure_credential(
        console_url=f"https://console.test:{port}",
        cvm_id="d1",
        token_file=token,
        credential_file=tmp_path / "state" / "credential",
        quoter=lambda rd: (b"", None),
        verify=str(ca.cert_path),
        timeout=5,
        connect_address="127.0.0.1",
    )


def test_dialled_by_address_verified_by_name(tmp_path: Path, ca: OriginCA) -> None:
    seen.clear()
    with _serve(ca, "console.test") as port:
        with pytest.raises(EnrollError, match="challenge has no nonce"):
            _dial(tmp_path, ca, port)
        assert seen == [("console.test", f"console.test:{port}")]


def test_a_certificate_for_another_name_is_refused_even_with_the_address_in_it(
    tmp_path: Path, ca: OriginCA
) -> None:
    seen.clear()
    with _serve(ca, "other.test") as port:
        with pytest.raises(EnrollError, match="Console unreachable"):
            _dial(tmp_path, ca, port)
        assert seen == []


def test_a_console_address_must_be_an_ipv4_address(tmp_path: Path, ca: OriginCA) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 32)
    with pytest.raises(EnrollError, match="not an IPv4 address"):
        ensure_credential(
            console_url="https://console.test",
            cvm_id="d1",
            token_file=token,
            credential_file=tmp_path / "credential",
            quoter=lambda rd: (b"", None),
            connect_address="console.test",
        )
