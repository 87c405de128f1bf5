"""One guest connection to a loopback port: QEMU user networking's `guestfwd=…-cmd:` runs this
once per TCP connection the guest opens to a forwarded address, with the connection on stdin and
stdout. (A `guestfwd=…-tcp:` chardev connects once, at QEMU's start, and carries a single guest
connection: HTTP clients that open one per request would get nothing after the first.)

Standard library only and started with `python -I -S`: it runs per request.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading


def _pump_in(sock: socket.socket) -> None:
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        sock.sendall(chunk)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def main(argv: list[str]) -> int:
    host, port = argv[1], int(argv[2])
    if host != "127.0.0.1":  # the stand-ins listen on loopback only
        return 2
    sock = socket.create_connection((host, port), timeout=30)
    threading.Thread(target=_pump_in, args=(sock,), daemon=True).start()
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        while chunk:
            chunk = chunk[os.write(1, chunk) :]
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
