"""Real components for proxy tests: a test CA, loopback origin servers that record what reaches
them, the proxy itself run through `umbra proxy serve`, clients, and a reader of the traffic log."""

from __future__ import annotations

import base64
import contextlib
import datetime
import gzip
import json
import logging
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import websockets.exceptions
import websockets.frames
import websockets.sync.server
import wsproto
import wsproto.events
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from umbra.proxy.identity import hash_credential, proxy_auth_header
from umbra.proxy.spool import FLUSH_INTERVAL

ROOT = Path(__file__).resolve().parents[2]
UMBRA = ROOT / ".venv" / "bin" / "umbra"

TEAM_SECRET = "TEAMSECRET-7f3a9c2e51d84b06a1e2"
PYPI_SECRET = "PYPISECRET-4b1d8e0c93a27f5e6d11"
ALICE_SECRET = "ALICE-PERSONAL-0c6e2f9a8b7d5e4c3b21"
BOB_SECRET = "BOB-PERSONAL-9e8d7c6b5a4f3e2d1c00"
ALL_SECRETS = (TEAM_SECRET, PYPI_SECRET, ALICE_SECRET, BOB_SECRET)
ALICE_TOKEN = "alice-tunnel-credential-1"
BOB_TOKEN = "bob-tunnel-credential-2"

ORIGIN_NAMES = [
    "api.test",
    "other.test",
    "evil.test",
    "ro.test",
    "ai.test",
    "git.test",
    "pypi.test",
    "ws.test",
    "plain.test",
    "rebind.test",
    "private.test",
    "metadata.test",
    "cgnat.test",
    "ula.test",
    "self.test",
    "loop2.test",
    "fault-request.test",
    "fault-requestheaders.test",
    "fault-response.test",
    "fault-responseheaders.test",
    "fault-server_connect.test",
    "fault-resolver.test",
    "xn--pi-6kc.test",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------ certificates


@dataclass
class TestCA:
    directory: Path
    cert_path: Path = field(init=False)
    key: ec.EllipticCurvePrivateKey = field(init=False)
    cert: x509.Certificate = field(init=False)

    def __post_init__(self) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Umbra test origin CA")])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.cert_path = self.directory / "origin-ca.pem"
        self.cert_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, names: list[str], ips: tuple[str, ...] = ()) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = [x509.DNSName(name) for name in names]
        for ip in ("127.0.0.1", *ips):
            sans.append(x509.IPAddress(__import__("ipaddress").ip_address(ip)))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        cert_path = self.directory / "origin.pem"
        key_path = self.directory / "origin-key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert_path, key_path


# ------------------------------------------------------------------ origin servers


@dataclass
class Seen:
    host: str
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    def raw(self) -> bytes:
        head = f"{self.method} {self.path}\n" + "\n".join(f"{k}: {v}" for k, v in self.headers)
        return head.encode("utf-8", "surrogateescape") + b"\n" + self.body


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[Seen] = []
        self.raw_tcp: list[bytes] = []

    def add(self, item: Seen) -> None:
        with self.lock:
            self.seen.append(item)

    def snapshot(self) -> list[Seen]:
        with self.lock:
            return list(self.seen)

    def host_saw(self, host: str, needle: bytes) -> bool:
        """Whether any request to `host` carried `needle` anywhere (line, headers, body)."""
        with self.lock:
            return any(
                seen.host.split(":")[0] == host and needle in seen.raw() for seen in self.seen
            )

    def contains(self, needle: bytes) -> bool:
        with self.lock:
            return any(needle in seen.raw() for seen in self.seen) or any(
                needle in chunk for chunk in self.raw_tcp
            )


Route = Callable[["OriginHandler", Seen], None]


class OriginHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    wbufsize = -1  # headers and body leave in one write (flushed after each request)
    server: OriginServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline().strip():
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        seen = Seen(
            host=self.headers.get("host", ""),
            method=self.command,
            path=self.path,
            headers=list(self.headers.items()),
            body=self._body(),
        )
        self.server.recorder.add(seen)
        hostname = seen.host.rsplit(":", 1)[0]
        route = self.server.routes.get(hostname)
        if route is not None:
            route(self, seen)
            return
        self.default(seen)

    def send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def chunked(
        self, pieces: list[bytes], gap: float, headers: dict[str, str] | None = None
    ) -> None:
        """A chunked response, each piece flushed on its own, `gap` seconds apart."""
        self.send_response(200)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        try:
            for index, piece in enumerate(pieces):
                if index and gap:
                    time.sleep(gap)
                if piece:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def default(self, seen: Seen) -> None:
        path = seen.path
        auth = " ".join(seen.header("authorization"))
        # Longer prefixes first: `/reflect` would also match `/reflect-b64`.
        if path.startswith("/reflect-b64"):
            self.send(200, base64.b64encode(auth.encode()))
        elif path.startswith("/reflect-header"):
            self.send(200, b"nothing here", {"x-echo": auth})
        elif path.startswith("/reflect-split"):
            # The credential straddles two chunks sent 0.3 s apart.
            middle = len(auth) // 2
            self.chunked([f"data: you sent: {auth[:middle]}".encode(), auth[middle:].encode()], 0.3)
        elif path.startswith("/reflect-gzip"):
            packed = gzip.compress(b"padding " * 2000 + f"you sent: {auth}".encode())
            pieces = [packed[i : i + 1000] for i in range(0, len(packed), 1000)]
            self.chunked(pieces, 0.0, {"content-encoding": "gzip"})
        elif path.startswith("/reflect"):
            self.send(200, f"you sent: {auth}".encode())
        elif path.startswith("/sse"):
            count = int(path.split("n=", 1)[1].split("&")[0])
            events = [f"data: event-{index}\n\n".encode() for index in range(count)]
            self.chunked(events, 0.4, {"content-type": "text/event-stream"})
        elif path.startswith("/stream-big"):
            size = int(path.split("n=", 1)[1])
            block = b"y" * 65536
            self.chunked([block] * (size // len(block)) + [b"y" * (size % len(block))], 0.0)
        elif path.startswith("/redirect"):
            target = path.split("to=", 1)[1]
            self.send(302, b"", {"location": target})
        elif path.startswith("/big"):
            size = int(path.split("n=", 1)[1])
            self.send(200, b"x" * size)
        elif path.startswith("/altsvc"):
            self.send(200, b"ok", {"alt-svc": 'h3=":443"; ma=86400'})
        else:
            self.send(200, b"origin ok\n", {"content-type": "text/plain"})

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _handle
    do_TRACE = _handle


class TlsHttpServer(ThreadingHTTPServer):
    """A threaded HTTP server on loopback, over TLS when given a context. The handshake runs in
    the connection's own thread (a client that stalls it holds up no other); `socket_timeout`
    stays on the connection for the request that follows."""

    daemon_threads = True
    socket_timeout = 10.0

    def __init__(self, handler: type[BaseHTTPRequestHandler], tls: ssl.SSLContext | None) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        if tls is not None:
            self.socket = tls.wrap_socket(
                self.socket, server_side=True, do_handshake_on_connect=False
            )

    def finish_request(self, request: Any, client_address: Any) -> None:
        if isinstance(request, ssl.SSLSocket):
            try:
                request.settimeout(self.socket_timeout)
                request.do_handshake()
            except (ssl.SSLError, OSError):
                return
        super().finish_request(request, client_address)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> Self:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self


class OriginServer(TlsHttpServer):
    def __init__(self, recorder: Recorder, tls: ssl.SSLContext | None) -> None:
        super().__init__(OriginHandler, tls)
        self.recorder = recorder
        self.routes: dict[str, Route] = {}
        self.connections = 0  # accepted TCP connections

    def finish_request(self, request: Any, client_address: Any) -> None:
        self.connections += 1
        super().finish_request(request, client_address)


class TcpEcho:
    """A raw TCP origin that records bytes and echoes them back (for tunnel tests)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with conn:
            conn.sendall(b"HELLO-TCP\n")
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                with self.recorder.lock:
                    self.recorder.raw_tcp.append(data)
                conn.sendall(data)


ORIGIN_PING = b"origin-ping-data"


class TlsWsServer:
    """A TLS WebSocket server (wsproto) on loopback: accepts every upgrade and answers a close;
    each connection runs in its own thread. Subclasses answer the other events (`on_event` yields
    the events to send, and may pause between them) and record what they need."""

    def __init__(self, tls: ssl.SSLContext) -> None:
        self.tls = tls
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    # -- hooks -----------------------------------------------------------------------------
    def on_data(self, data: bytes) -> None:
        """Every chunk read from a connection, before it is parsed."""

    def on_event(
        self, request: wsproto.events.Request, event: wsproto.events.Event
    ) -> Iterator[wsproto.events.Event]:
        """The answer to a message, ping or pong of the connection `request` opened."""
        return iter(())

    def on_close(
        self, request: wsproto.events.Request, event: wsproto.events.CloseConnection
    ) -> None:
        """The client closed (the close is answered)."""

    def on_end(self, how: str) -> None:
        """The connection ended otherwise: `eof`, or `error` (a socket or protocol error)."""

    # -- the loop ----------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(raw,), daemon=True).start()

    def _handle(self, raw: socket.socket) -> None:
        try:
            conn = self.tls.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            return
        ws = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
        request = wsproto.events.Request(host="", target="")
        conn.settimeout(10)
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    self.on_end("eof")
                    return
                self.on_data(data)
                ws.receive_data(data)
                for event in ws.events():
                    if isinstance(event, wsproto.events.Request):
                        request = event
                        conn.sendall(ws.send(wsproto.events.AcceptConnection()))
                    elif isinstance(event, wsproto.events.CloseConnection):
                        self.on_close(request, event)
                        conn.sendall(ws.send(event.response()))
                        return
                    else:
                        for answer in self.on_event(request, event):
                            conn.sendall(ws.send(answer))
        except (OSError, wsproto.utilities.LocalProtocolError):
            self.on_end("error")
        finally:
            conn.close()


class WsOrigin(TlsWsServer):
    """A TLS WebSocket origin that records every message it receives; it answers pings with a
    pong of its own payload, and pings the client (`ORIGIN_PING`) when sent `ping-me`."""

    def __init__(self, recorder: Recorder, tls: ssl.SSLContext) -> None:
        self.recorder = recorder
        self.messages: list[bytes | str] = []
        # (request target, frame kind, payload or close reason) of every control frame received.
        self.control: list[tuple[str, str, bytes]] = []
        super().__init__(tls)

    def on_data(self, data: bytes) -> None:
        with self.recorder.lock:
            self.recorder.raw_tcp.append(data)

    def on_event(
        self, request: wsproto.events.Request, event: wsproto.events.Event
    ) -> Iterator[wsproto.events.Event]:
        if isinstance(event, wsproto.events.Message):
            if event.message_finished:
                self.messages.append(event.data)
            if event.data == "ping-me":
                # Try to carry data to the client in a ping of the origin's own.
                yield wsproto.events.Ping(payload=ORIGIN_PING)
            yield wsproto.events.TextMessage(data="echo")
        elif isinstance(event, wsproto.events.Ping):
            self.control.append((request.target, "ping", bytes(event.payload)))
            # Answer, and try to carry data back in the pong.
            yield wsproto.events.Pong(payload=b"origin-pong-data")
        elif isinstance(event, wsproto.events.Pong):
            self.control.append((request.target, "pong", bytes(event.payload)))

    def on_close(
        self, request: wsproto.events.Request, event: wsproto.events.CloseConnection
    ) -> None:
        self.control.append((request.target, "close", (event.reason or "").encode()))


class FrameLog(logging.Handler):
    """Every frame a `websockets` endpoint sends (`>`) or receives (`<`), from its debug log."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.DEBUG)
        self.frames: list[tuple[str, websockets.frames.Frame]] = []
        self.logger = logging.getLogger(name)
        self.logger.setLevel(logging.DEBUG)
        self.logger.propagate = False
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if args and isinstance(args[0], websockets.frames.Frame):
            self.frames.append((str(record.msg)[:1], args[0]))

    def payloads(self, direction: str, opcode: websockets.frames.Opcode) -> list[bytes]:
        return [
            bytes(f.data) for d, f in list(self.frames) if d == direction and f.opcode is opcode
        ]

    def carried(self, needle: bytes) -> bool:
        """Whether any frame this endpoint received carried `needle` (after unmasking)."""
        return any(needle in bytes(f.data) for d, f in list(self.frames) if d == "<")


class KeepAliveOrigin:
    """A TLS WebSocket origin built on `websockets` that echoes messages and runs the library's
    own keep-alive (a ping with a random payload every 0.5 s; no matching pong within 1 s closes
    the connection)."""

    INTERVAL = 0.5
    TIMEOUT = 1.0

    def __init__(self, tls: ssl.SSLContext) -> None:
        self.log = FrameLog(f"uws.origin.{os.getpid()}")
        self.server = websockets.sync.server.serve(
            self._echo,
            "127.0.0.1",
            0,
            ssl=tls,
            ping_interval=self.INTERVAL,
            ping_timeout=self.TIMEOUT,
            logger=self.log.logger,
        )
        self.port = int(self.server.socket.getsockname()[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def _echo(connection: websockets.sync.server.ServerConnection) -> None:
        with contextlib.suppress(websockets.exceptions.ConnectionClosed):
            for message in connection:
                connection.send(message)

    def shutdown(self) -> None:
        self.server.shutdown()


# ------------------------------------------------------------------ traffic log


class TrafficLog:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def records(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for path in sorted(self.directory.glob("segment-*.jsonl")):
            for line in path.read_bytes().splitlines():
                if line.strip():
                    with contextlib.suppress(ValueError):
                        out.append(json.loads(line))
        return out

    def settled(self) -> list[dict[str, Any]]:
        """The records once the spool is quiet: it commits in groups (proxy/spool.FLUSH_INTERVAL),
        so a request's record can land up to one interval after its answer."""
        records = self.records()
        while True:
            time.sleep(3 * FLUSH_INTERVAL)
            now = self.records()
            if len(now) == len(records):
                return now
            records = now

    def mark(self) -> int:
        # Settle first, or an earlier request's late record counts as "after the mark".
        return len(self.settled())

    def wait_for(
        self, mark: int, predicate: Callable[[dict[str, Any]], bool], timeout: float = 5.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            new = self.records()[mark:]
            for record in new:
                if predicate(record):
                    return record
            if time.monotonic() > deadline:
                raise AssertionError(f"no matching traffic-log record; new records: {new}")
            time.sleep(0.05)


# ------------------------------------------------------------------ the proxy


@dataclass
class ProxyProcess:
    process: subprocess.Popen[bytes]
    port: int
    confdir: Path
    log: TrafficLog
    output: Path

    @property
    def ca(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def url(self, token: str = ALICE_TOKEN, cvm: str = "cvm-alice") -> str:
        return f"http://{cvm}:{token}@127.0.0.1:{self.port}"

    def stop(self) -> str:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return self.output.read_text(errors="replace")


def start_proxy(args: list[str], workdir: Path, port: int | None = None) -> ProxyProcess:
    port = port or free_port()
    confdir = workdir / "mitm-ca"
    spool = workdir / "spool"
    output = workdir / f"proxy-{port}.log"
    handle = output.open("wb")
    process = subprocess.Popen(
        [
            str(UMBRA),
            "proxy",
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--confdir",
            str(confdir),
            "--traffic-log",
            str(spool),
            # One process unless a test asks for workers (each worker spools on its own).
            *([] if "--workers" in args else ["--workers", "1"]),
            *args,
        ],
        stdout=handle,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = output.read_text(errors="replace")
        if "umbra proxy listening on" in text:
            return ProxyProcess(process, port, confdir, TrafficLog(spool), output)
        if process.poll() is not None:
            raise RuntimeError(f"proxy exited: {text}")
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"proxy did not start: {output.read_text(errors='replace')}")


def write_identities(path: Path) -> None:
    path.write_text(
        json.dumps(
            {
                "cvms": [
                    {
                        "cvm_id": "cvm-alice",
                        "owner": "alice",
                        "team": "acme",
                        "profiles": ["testing"],
                        "credential_sha256": hash_credential(ALICE_TOKEN),
                    },
                    {
                        "cvm_id": "cvm-bob",
                        "owner": "bob",
                        "team": "acme",
                        "profiles": ["testing"],
                        "credential_sha256": hash_credential(BOB_TOKEN),
                    },
                    {
                        "cvm_id": "cvm-nothing",
                        "owner": "carol",
                        "team": "acme",
                        "profiles": [],
                        "credential_sha256": hash_credential("carol-credential"),
                    },
                ]
            }
        )
    )


def write_secrets(path: Path) -> None:
    path.write_text(
        json.dumps(
            {
                "team": {"github-bot": TEAM_SECRET, "pypi": PYPI_SECRET},
                "personal": {"alice": {"openai": ALICE_SECRET}, "bob": {"openai": BOB_SECRET}},
            }
        )
    )
    path.chmod(0o600)


# ------------------------------------------------------------------ clients


def auth_header(cvm: str = "cvm-alice", token: str = ALICE_TOKEN) -> str:
    return proxy_auth_header(cvm, token)


def read_response(sock: socket.socket | ssl.SSLSocket, timeout: float = 10) -> bytes:
    """Read one HTTP/1.1 response (headers plus Content-Length body), or until close."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, OSError):
            return data
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    match = re.search(rb"(?i)content-length:\s*(\d+)", head)
    if match:
        want = int(match.group(1))
        while len(body) < want:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, OSError):
                break
            if not chunk:
                break
            body += chunk
    return head + b"\r\n\r\n" + body


def status_of(response: bytes) -> int:
    match = re.match(rb"HTTP/1\.[01] (\d{3})", response)
    return int(match.group(1)) if match else 0


def connect_tunnel(
    proxy: ProxyProcess,
    target: str,
    *,
    sni: str | None,
    auth: str | None = None,
    alpn: list[str] | None = None,
    tls: bool = True,
) -> tuple[socket.socket | ssl.SSLSocket, bytes]:
    """CONNECT through the proxy, then (optionally) TLS with a chosen SNI (None: no SNI)."""
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    headers = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
    headers += f"Proxy-Authorization: {auth or auth_header()}\r\n\r\n"
    sock.sendall(headers.encode())
    response = read_response(sock)
    if status_of(response) != 200 or not tls:
        return sock, response
    context = ssl.create_default_context(cafile=str(proxy.ca))
    context.check_hostname = False
    if alpn:
        context.set_alpn_protocols(alpn)
    wrapped = context.wrap_socket(sock, server_hostname=sni)
    return wrapped, response


def curl(
    proxy: ProxyProcess, url: str, *args: str, token: str = ALICE_TOKEN, cvm: str = "cvm-alice"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "curl",
            "-sS",
            "--max-time",
            "20",
            "--proxy",
            f"http://127.0.0.1:{proxy.port}",
            "--proxy-user",
            f"{cvm}:{token}",
            "--cacert",
            str(proxy.ca),
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
            *args,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def curl_status(result: subprocess.CompletedProcess[str]) -> int:
    return int(result.stdout.rsplit("\n", 1)[-1] or 0)


def python() -> str:
    return sys.executable
