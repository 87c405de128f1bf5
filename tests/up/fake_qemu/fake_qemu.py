"""A stand-in for qemu-system-x86_64 (run under that name by a wrapper): it takes QEMU's command
line as the qemu provider builds it, writes to the `-serial file:` the launch agent's `started`
line (and counts its boots beside the data disk), serves QMP on the `-qmp` socket and exits on
`system_powerdown`."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def main() -> None:
    args = sys.argv[1:]
    qmp = _value(args, "-qmp").removeprefix("unix:").split(",")[0]
    serial = _value(args, "-serial").removeprefix("file:")
    data = next(a for a in args if a.startswith("file=") and "/data.raw" in a)
    disk = Path(data.removeprefix("file=").split(",")[0])
    count = disk.with_name("fake-boots")
    boots = int(count.read_text()) + 1 if count.exists() else 1
    count.write_text(str(boots))
    time.sleep(1)  # a boot takes a while
    Path(serial).write_text(
        f"umbra-launch: dev-cvm {disk.parent.name} started, compose-hash 0000\n"
    )
    server = socket.socket(socket.AF_UNIX)
    server.bind(qmp)
    server.listen(1)
    while True:
        conn, _ = server.accept()
        f = conn.makefile("rwb")
        f.write(b'{"QMP": {}}\n')
        f.flush()
        for line in f:
            command = json.loads(line)["execute"]
            f.write(b'{"return": {}}\n')
            f.flush()
            if command == "system_powerdown":
                time.sleep(0.5)
                os.unlink(qmp)
                sys.exit(0)


if __name__ == "__main__":
    main()
