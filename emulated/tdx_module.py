"""The emulated clouds' TDX module: the host plays the hardware the guest lacks under QEMU/TCG.

One per VM. QEMU connects the guest's virtio-serial port `org.umbra.tdx-module` to this unix
socket (a `socket` chardev, QEMU the client); each connection is one boot of the TD, so it starts
from a fresh TD: RTMR0-2 the simulated boot values of `image` (attest.simulator.boot_events),
RTMR3 zero; its CCEL (the firmware's event log of RTMR0-2) is served to the guest, which
prepends it to its own log. The guest extends RTMR3 by digest only, as the kernel's RTMR sysfs file does (the
module never sees event names or payloads: the guest's event log says them, and a verifier
replays it against the quoted RTMR3), and asks for quotes over its report data; quotes are
laid out as Intel's and signed by the simulated PKI (attest.simpki), so only a verifier that
trusts the simulated root for a `tee: simulated` release accepts them. The guest side is
attest.tdx_port (wire format there).
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from umbra.attest.errors import AttestError
from umbra.attest.eventlog import DIGEST_LEN, RUNTIME_IMR, dump_ccel
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.tdx_port import MAX_LINE


class TdxModule:
    """A unix socket server; `boots` holds each connection's TD, in order (tests read their
    RTMRs; the operations each asked are in `requests`, never report data or quotes)."""

    def __init__(self, socket_path: Path, pki: SimulatedPki, image: str) -> None:
        self.socket_path = socket_path
        self.pki = pki
        self.image = image
        self.boots: list[SimulatedTdx] = []
        self.requests: list[str] = []
        self._lock = threading.Lock()
        self._server: socket.socket | None = None

    def start(self) -> TdxModule:
        self.socket_path.unlink(missing_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(self.socket_path))
        self.socket_path.chmod(0o600)
        server.listen(4)
        self._server = server
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def close(self) -> None:
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)
            self._server.close()
            self._server = None
        self.socket_path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def serving(self) -> Iterator[TdxModule]:
        self.start()
        try:
            yield self
        finally:
            self.close()

    def _accept(self) -> None:
        server = self._server
        while server is not None:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            td = SimulatedTdx(self.pki, image=self.image)  # a new boot: a fresh TD
            with self._lock:
                self.boots.append(td)
            threading.Thread(target=self._serve, args=(conn, td), daemon=True).start()

    def _serve(self, conn: socket.socket, td: SimulatedTdx) -> None:
        with conn:
            f = conn.makefile("rwb")
            while True:
                try:
                    line = f.readline(MAX_LINE)
                except OSError:
                    return
                if not line:
                    return
                answer = self.answer(td, line)
                if answer is None:
                    continue
                try:
                    f.write(json.dumps(answer).encode() + b"\n")
                    f.flush()
                except OSError:
                    return

    def answer(self, td: SimulatedTdx, line: bytes) -> dict[str, Any] | None:
        """One request's answer; None for a line that is not a request (no id to answer)."""
        try:
            request = json.loads(line)
        except ValueError:
            return None
        if not isinstance(request, dict) or not isinstance(request.get("id"), str):
            return None
        ident, op = request["id"], request.get("op")
        with self._lock:
            self.requests.append(str(op))
        try:
            if op == "extend":
                return {"id": ident, "ok": _extend(td, request)}
            if op == "ccel":
                firmware = [e for e in td.event_log() if e.imr != RUNTIME_IMR]
                return {"id": ident, "ccel": base64.b64encode(dump_ccel(firmware)).decode()}
            if op == "quote":
                report_data = _hex(request, "report_data", 64)
                return {"id": ident, "quote": base64.b64encode(td.quote(report_data)).decode()}
            return {"id": ident, "error": f"unknown op {op!r} (extend, quote, ccel)"}
        except (AttestError, ValueError) as exc:
            return {"id": ident, "error": str(exc)}


def _hex(request: dict[str, Any], key: str, size: int) -> bytes:
    value = request.get(key)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise ValueError(f"{key} must be {size} bytes of hex")
    return raw


def _extend(td: SimulatedTdx, request: dict[str, Any]) -> bool:
    # Only RTMR3 is the guest's to extend (RTMR0-2 are the firmware's, done before the guest).
    if request.get("rtmr") != RUNTIME_IMR:
        raise ValueError(f"only RTMR{RUNTIME_IMR} is extended at runtime")
    td.extend_digest(_hex(request, "digest", DIGEST_LEN), RUNTIME_IMR)
    return True
