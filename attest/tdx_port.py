"""The emulated clouds' TDX module, seen from the guest: a virtio-serial port to the host.

On a QEMU/TCG guest there is no TDX module, so the host plays it, as QEMU plays the rest of the
hardware (umbra.emulated.tdx_module): it keeps the TD's RTMRs and signs quotes with the
simulated Intel-style PKI. The guest reaches it only through the character device
`/dev/virtio-ports/org.umbra.tdx-module` (root-only, like the TDCALLs the kernel makes for
configfs-tsm and the RTMR sysfs file): no network address, nothing a container can dial.

Wire format: one JSON object per line each way. Requests `{"id", "op": "extend", "rtmr": 3,
"digest": hex}`, `{"id", "op": "quote", "report_data": hex}` or `{"id", "op": "ccel"}` (the
firmware's event log of RTMR0-2, as a TD's CCEL ACPI table holds it, which a verifier replays
with the guest's RTMR3 events); answers `{"id", "ok": true}`, `{"id", "quote": base64}`,
`{"id", "ccel": base64}` or `{"id", "error": text}`. One port carries one byte stream, so a
client holds an exclusive `flock` on it for its exchange, and skips answers with another id
(a client killed mid-exchange leaves its answer behind). The guest's virtio_console driver
admits one opener at a time (EBUSY for the next, before any flock): a client retries the open
for up to `timeout`, so a Dev CVM's forwarder re-enrolling and its ingress quoting for an
`umbra ssh` at the same moment take turns instead of one failing.

Its quotes chain to the simulated root: a verifier accepts them only where a `tee: simulated`
release and the simulated root are configured (never in production).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import json
import os
import select
import time
import uuid
from pathlib import Path
from typing import Any

from umbra.attest.errors import AttestError, QuoteSourceError
from umbra.attest.eventlog import Event, parse_ccel

TDX_PORT_NAME = "org.umbra.tdx-module"
TDX_PORT = Path("/dev/virtio-ports") / TDX_PORT_NAME
MAX_LINE = 1 << 20  # a quote is ~5 KiB; base64 and JSON around it stay far below


def find_port(sys_class: Path = Path("/sys/class/virtio-ports"), dev: Path = Path("/dev")) -> Path:
    """The port's device: udev's symlink, else its node found by name in sysfs (udev may not
    have made the link yet this early in boot)."""
    if TDX_PORT.exists():
        return TDX_PORT
    with contextlib.suppress(OSError):
        for port in sorted(sys_class.iterdir()):
            with contextlib.suppress(OSError):
                if (port / "name").read_text().strip() == TDX_PORT_NAME:
                    return dev / port.name
    return TDX_PORT


class TdxModulePort:
    """One exchange per call, under an exclusive lock on the port. `wait`: how long to wait for
    the port's device to appear (the virtio_console module and udev, early in boot)."""

    def __init__(self, path: Path | None = None, timeout: float = 30.0, wait: float = 0.0) -> None:
        self.path = path
        self.timeout = timeout
        self.wait = wait

    def _device(self) -> Path:
        deadline = time.monotonic() + self.wait
        while True:
            path = self.path or find_port()
            if path.exists() or time.monotonic() >= deadline:
                return path
            time.sleep(0.5)

    def extend(self, rtmr: int, digest: bytes) -> None:
        self._ask({"op": "extend", "rtmr": rtmr, "digest": digest.hex()})

    def quote(self, report_data: bytes) -> bytes:
        answer = self._ask({"op": "quote", "report_data": report_data.hex()})
        try:
            return base64.b64decode(answer["quote"], validate=True)
        except (KeyError, TypeError, ValueError):
            raise QuoteSourceError("the TDX module's answer has no quote") from None

    def firmware_events(self) -> list[Event]:
        """RTMR0-2's events, from the module's CCEL (the firmware's part of the TD's log)."""
        answer = self._ask({"op": "ccel"})
        try:
            return parse_ccel(base64.b64decode(answer["ccel"], validate=True))
        except (KeyError, TypeError, ValueError, AttestError):
            raise QuoteSourceError("the TDX module's answer has no valid CCEL") from None

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        ident = uuid.uuid4().hex
        path = self._device()
        fd = self._open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, json.dumps({"id": ident, **request}).encode() + b"\n")
            return self._answer(fd, ident, path)
        except OSError as exc:
            raise QuoteSourceError(f"{path}: {exc.strerror or exc}") from None
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _open(self, path: Path) -> int:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return os.open(path, os.O_RDWR | os.O_NOCTTY)
            except OSError as exc:
                if exc.errno == errno.EBUSY and time.monotonic() < deadline:
                    time.sleep(0.05)  # another process's exchange holds the port
                    continue
                raise QuoteSourceError(
                    f"cannot open {path} ({exc.strerror}); is this an emulated-cloud VM "
                    "with the host's TDX module attached?"
                ) from None

    def _answer(self, fd: int, ident: str, path: Path) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        buf = b""
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    answer = json.loads(line)
                except ValueError:
                    continue  # a torn line from an earlier, killed exchange
                if not isinstance(answer, dict) or answer.get("id") != ident:
                    continue
                if "error" in answer:
                    raise QuoteSourceError(f"the TDX module refused: {answer['error']}")
                return answer
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise QuoteSourceError(f"{path}: no answer from the TDX module")
            chunk = os.read(fd, 65536)
            if not chunk:  # virtio-serial: the host end is not connected
                time.sleep(0.1)
            buf += chunk
            if len(buf) > MAX_LINE:
                raise QuoteSourceError(f"{path}: the TDX module's answer is too long")


class TdxModuleSource:
    """The quoting interface (quote_source.QuoteSource) over the host's TDX module. `simulated`:
    its quotes chain to the simulated root."""

    simulated = True

    def __init__(self, port: TdxModulePort | None = None) -> None:
        self.port = port or TdxModulePort()

    def get_quote(self, report_data: bytes) -> bytes:
        if len(report_data) != 64:
            raise QuoteSourceError(f"report_data must be 64 bytes, got {len(report_data)}")
        return self.port.quote(report_data)


# ---- the Security CVM's container: quotes only, through a socket in its launch directory -----

QUOTE_SOCKET_NAME = "tdx-quote.sock"
_REQUEST_MAX = 4096


class TdxQuoteSocketSource:
    """The quoting interface for a container on an emulated-cloud VM: one `quote` per connection
    to the guest's quote relay (`serve_quote_relay`), the analogue of the configfs-tsm directory
    a TDX guest binds into its Security CVM's proxy. Quotes only: no extend, no CCEL."""

    simulated = True

    def __init__(self, path: Path, timeout: float = 60.0) -> None:
        self.path = path
        self.timeout = timeout

    def get_quote(self, report_data: bytes) -> bytes:
        import socket

        if len(report_data) != 64:
            raise QuoteSourceError(f"report_data must be 64 bytes, got {len(report_data)}")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout)
                sock.connect(str(self.path))
                sock.sendall(json.dumps({"report_data": report_data.hex()}).encode() + b"\n")
                answer = _read_line(sock)
        except OSError as exc:
            raise QuoteSourceError(
                f"{self.path}: {exc.strerror or exc} (the launch agent's TDX quote relay)"
            ) from None
        try:
            doc = json.loads(answer)
            if "error" in doc:
                raise QuoteSourceError(f"the TDX quote relay refused: {doc['error']}")
            return base64.b64decode(doc["quote"], validate=True)
        except (KeyError, TypeError, ValueError):
            raise QuoteSourceError(f"{self.path}: the relay's answer has no quote") from None


def _read_line(sock: Any) -> bytes:
    buf = b""
    while b"\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_LINE:
            raise OSError("answer too long")
    return buf.split(b"\n", 1)[0]


def quote_relay_answer(line: bytes, port: TdxModulePort) -> dict[str, Any]:
    """One request of the relay: exactly `{"report_data": 128 hex digits}`, nothing else (no
    extend: a container must never move RTMR3, as on TDX it cannot)."""
    try:
        doc = json.loads(line)
        if not isinstance(doc, dict) or set(doc) != {"report_data"}:
            raise ValueError
        report_data = bytes.fromhex(doc["report_data"])
        if len(report_data) != 64:
            raise ValueError
    except (ValueError, TypeError):
        return {"error": 'want one line {"report_data": 64 bytes in hex}'}
    try:
        return {"quote": base64.b64encode(port.quote(report_data)).decode()}
    except QuoteSourceError as exc:
        return {"error": str(exc)}


def serve_quote_relay(path: Path, port: TdxModulePort, uid: int | None = None) -> None:
    """Serve quotes on the unix socket `path` (0600, owned by `uid`: the proxy's), relayed to
    the host's TDX module over the port, until killed. Runs as root (the port is root-only)."""
    import socketserver
    import threading

    # One exchange at a time: virtio-serial lets one process hold the port open (EBUSY).
    one = threading.Lock()

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            self.request.settimeout(30)
            try:
                line = self.rfile.readline(_REQUEST_MAX)
            except OSError:
                return
            with one:
                answer = quote_relay_answer(line, port)
            with contextlib.suppress(OSError):
                self.wfile.write(json.dumps(answer).encode() + b"\n")

    # Bound under a temporary name and renamed into place once its mode and owner are set: the
    # socket at `path` is never one the proxy cannot open (a connect between bind and chown
    # was refused) nor, for an instant, anyone else's to open.
    staging = path.with_name(path.name + ".new")
    staging.unlink(missing_ok=True)
    server = socketserver.ThreadingUnixStreamServer(str(staging), Handler)
    os.chmod(staging, 0o600)
    if uid is not None:
        os.chown(staging, uid, uid)
    os.replace(staging, path)
    server.daemon_threads = True
    server.serve_forever()
