"""A stand-in for qemu-system-x86_64 (run under that name by a wrapper): it takes QEMU's command
line as the qemu provider builds it, writes to the `-serial file:` the launch agent's `started`
line for the CVM's role (and counts its boots beside the data disk), serves QMP on the command
socket (the last `-qmp`) and exits on `system_powerdown` or, as under `-no-reboot`, on
`system_reset`, first sending the `SHUTDOWN` event with QEMU's reason to a client of the events
socket (the first `-qmp`)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

REASONS = {"system_powerdown": "guest-shutdown", "system_reset": "host-qmp-system-reset"}


def _qmp_paths(args: list[str]) -> list[str]:
    return [args[i + 1].removeprefix("unix:").split(",")[0]
            for i, a in enumerate(args) if a == "-qmp"]  # fmt: skip


def _listen(path: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    return server


def main() -> None:
    args = sys.argv[1:]
    *events_path, qmp = _qmp_paths(args)
    serial = args[args.index("-serial") + 1].removeprefix("file:")
    data = next(a for a in args if a.startswith("file=") and "/data.raw" in a)
    disk = Path(data.removeprefix("file=").split(",")[0])
    count = disk.with_name("fake-boots")
    boots = int(count.read_text()) + 1 if count.exists() else 1
    count.write_text(str(boots))
    # The Security VM publishes its tunnel endpoint (guest port 8443), a Dev VM its ingress.
    role = "security-cvm" if any("-:8443" in a for a in args) else "dev-cvm"
    watchers: list[socket.socket] = []
    if events_path:
        events = _listen(events_path[0])

        def accept() -> None:
            conn, _ = events.accept()
            f = conn.makefile("rwb")
            f.write(b'{"QMP": {}}\n')
            f.flush()
            f.readline()  # qmp_capabilities
            f.write(b'{"return": {}}\n')
            f.flush()
            watchers.append(conn)

        threading.Thread(target=accept, daemon=True).start()
    server = _listen(qmp)  # QEMU's monitor is there at once
    time.sleep(1)  # a boot takes a while
    Path(serial).write_text(f"umbra-launch: {role} {disk.parent.name} started, compose-hash 0\n")
    while True:
        conn, _ = server.accept()
        f = conn.makefile("rwb")
        f.write(b'{"QMP": {}}\n')
        f.flush()
        for line in f:
            command = json.loads(line)["execute"]
            f.write(b'{"return": {}}\n')
            f.flush()
            if command in REASONS:
                time.sleep(0.5)
                event = {"event": "SHUTDOWN", "data": {"guest": False, "reason": REASONS[command]}}
                for watcher in watchers:
                    watcher.sendall(json.dumps(event).encode() + b"\n")
                os.unlink(qmp)
                sys.exit(0)


if __name__ == "__main__":
    main()
