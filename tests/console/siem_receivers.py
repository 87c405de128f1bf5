"""Real SIEM receivers for the export tests: rsyslog (Debian's, imtcp with the gtls driver,
RFC 5425 octet-counted framing) writing to a file, and an OTLP/HTTP logs endpoint that parses
every request with opentelemetry-proto's `ExportLogsServiceRequest` (strict proto3 JSON: an
unknown or mistyped field fails the request). No OpenTelemetry Collector or fluent-bit is
packaged in Debian bookworm, so the OTLP side is this protobuf-validating receiver."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from tests.proxy.harness import TestCA

RSYSLOGD = shutil.which("rsyslogd") or "/usr/sbin/rsyslogd"


@dataclass
class Pki:
    ca: Path
    cert: Path
    key: Path


def make_pki(directory: Path) -> Pki:
    """The receivers' server certificate (127.0.0.1 and localhost) from the suite's one test CA."""
    ca = TestCA(directory)
    cert, key = ca.issue(["localhost"])
    return Pki(ca.cert_path, cert, key)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Rsyslog:
    """rsyslogd in the foreground on a loopback TLS port, each message's MSGID, structured data
    and MSG written as one line of `out`."""

    def __init__(self, directory: Path, pki: Pki) -> None:
        self.directory = directory
        self.out = directory / "received.log"
        self.port = free_port()
        self.url = f"tls://127.0.0.1:{self.port}"
        self.config = directory / "rsyslog.conf"
        self.config.write_text(
            f'global(workDirectory="{directory}" maxMessageSize="64k"\n'
            f'  DefaultNetstreamDriver="gtls" DefaultNetstreamDriverCAFile="{pki.ca}"\n'
            f'  DefaultNetstreamDriverCertFile="{pki.cert}"'
            f' DefaultNetstreamDriverKeyFile="{pki.key}")\n'
            'module(load="imtcp" StreamDriver.Name="gtls" StreamDriver.Mode="1"'
            ' StreamDriver.AuthMode="anon")\n'
            f'input(type="imtcp" port="{self.port}" address="127.0.0.1")\n'
            'template(name="line" type="string" string="%msgid% %structured-data% %msg%\\n")\n'
            f'action(type="omfile" file="{self.out}" template="line" flushOnTXEnd="on")\n'
        )
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [RSYSLOGD, "-n", "-f", str(self.config), "-i", str(self.directory / "pid")],
            stdout=subprocess.DEVNULL,
            stderr=(self.directory / "rsyslogd.err").open("ab"),
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError((self.directory / "rsyslogd.err").read_text()) from None
                time.sleep(0.05)
        raise RuntimeError("rsyslogd did not listen")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()  # rsyslogd flushes its queues at SIGTERM
            self.process.wait(timeout=15)
            self.process = None

    def events(self) -> list[tuple[str, dict[str, Any]]]:
        """(MSGID, event) per received line."""
        if not self.out.exists():
            return []
        received = []
        for line in self.out.read_text().splitlines():
            msgid, _, rest = line.partition(" ")
            _, _, message = rest.partition("] ")
            received.append((msgid, json.loads(message.strip())))
        return received

    def wait_for(self, count: int, timeout: float = 15.0) -> list[tuple[str, dict[str, Any]]]:
        deadline = time.monotonic() + timeout
        while True:
            events = self.events()
            if len(events) >= count or time.monotonic() > deadline:
                return events
            time.sleep(0.1)


@dataclass
class OtlpReceiver:
    pki: Pki
    down: bool = False
    requests: int = 0
    refused: list[float] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests += 1
                if receiver.down or self.path != "/v1/logs":
                    receiver.refused.append(time.monotonic())
                    self.send_response(503)
                    self.end_headers()
                    return
                assert self.headers["Content-Type"] == "application/json"
                request = json_format.Parse(body, ExportLogsServiceRequest())  # strict schema
                receiver.raw.append(body)
                for resource in request.resource_logs:
                    for scope in resource.scope_logs:
                        for record in scope.log_records:
                            receiver.records.append(json_format.MessageToDict(record))
                answer = b"{}"
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.pki.cert, self.pki.key)
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self._server.server_address[1]}/v1/logs"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(r["body"]["stringValue"]) for r in self.records]
