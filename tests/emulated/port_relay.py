"""A character device standing in for the guest's virtio-serial port to the host's TDX module: a
raw pty whose bytes are relayed to the module's unix socket, as QEMU's chardev relays the port's
(one connection for the VM's life: one boot of the TD)."""

from __future__ import annotations

import contextlib
import os
import pty
import socket
import threading
import tty
from collections.abc import Iterator
from pathlib import Path

from umbra.emulated.tdx_module import TdxModule


@contextlib.contextmanager
def port_to(module: TdxModule) -> Iterator[Path]:
    """A character device whose bytes reach `module` as the guest's port's do: QEMU's chardev
    is one connection to the module's socket for the VM's life."""
    master, slave = pty.openpty()
    tty.setraw(slave)  # a virtio-serial port has no line discipline
    path = Path(os.ttyname(slave))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(module.socket_path))
    stop = threading.Event()

    def up() -> None:
        with contextlib.suppress(OSError):  # closed at the end of the test
            while not stop.is_set():
                conn.sendall(os.read(master, 65536))

    def down() -> None:
        with contextlib.suppress(OSError):
            while chunk := conn.recv(65536):
                while chunk:
                    chunk = chunk[os.write(master, chunk) :]

    threads = [threading.Thread(target=f, daemon=True) for f in (up, down)]
    for t in threads:
        t.start()
    try:
        yield path
    finally:
        stop.set()
        conn.close()
        os.close(slave)
        os.close(master)
