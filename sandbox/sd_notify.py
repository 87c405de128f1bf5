"""systemd's readiness protocol (sd_notify(3)), without libsystemd: one datagram to the socket
systemd names in $NOTIFY_SOCKET (a path, or `@name` for the abstract namespace).

Why: a `Type=notify` unit's `systemctl start` returns only once the service says READY=1, so
whoever starts it (the launch agent, then the cloud's ready report) knows it serves. Under a
slow boot a `Type=exec` service was still importing when the agent reported ready: the first
`umbra ssh` attempts of an emulated boot were reset for minutes."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

READY = b"READY=1"


def notify_ready(environ: Mapping[str, str] = os.environ) -> bool:
    """Tells systemd this service is ready; False when not run under a notify unit (no socket).
    A socket that is named but cannot be reached raises OSError: systemd then times the start
    out and the unit fails (closed), never a service that looks ready and is not."""
    name = environ.get("NOTIFY_SOCKET")
    if not name:
        return False
    address = "\0" + name[1:] if name.startswith("@") else name
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(READY)
    return True
