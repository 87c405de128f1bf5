"""A warm helper for the ProxyCommand: the same checks per connection, without paying the
interpreter's start and imports (≈0.3-0.7 s) for every connection.

`cli/ssh_fastproxy.py` (stdlib only, run with `python -S -I`, `ProxyUseFdpass yes`) asks this
agent over a private Unix socket to attest one CVM. The agent runs exactly what `umbra ssh-proxy`
runs (`ssh_proxy.attest`: Console lookup, aTLS, quote verification, host-key pin) for that one
connection, then hands ssh one end of a socketpair and relays the other end to the verified aTLS
session; on refusal it sends back the one-line reason. It exits after `IDLE_EXIT` seconds idle or
when its socket is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
from pathlib import Path

from umbra.cli.ssh_attest import Refused
from umbra.cli.ssh_proxy import attest

IDLE_EXIT = 900.0


class Agent:
    def __init__(self) -> None:
        self.active = 0
        self.last = asyncio.get_running_loop().time()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.active += 1
        try:
            await self._handle(reader, writer)
        finally:
            self.active -= 1
            self.last = asyncio.get_running_loop().time()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await asyncio.wait_for(reader.readline(), 10))
            cvm_id = str(request["cvm"])
        except (ValueError, KeyError, TypeError, TimeoutError):
            writer.close()
            return
        try:
            session = await attest(cvm_id)
        except Refused as exc:
            line = " ".join(f"{exc.check}: {exc.reason}".split())[:800]
            writer.write(json.dumps({"ok": False, "line": line}).encode() + b"\n")
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()
            return
        except Exception as exc:  # still one line for the client, never a traceback
            line = " ".join(f"internal: {type(exc).__name__}: {exc}".split())[:800]
            writer.write(json.dumps({"ok": False, "line": line}).encode() + b"\n")
            writer.close()
            return
        ours, theirs = socket.socketpair()
        try:
            raw = socket.fromfd(
                writer.get_extra_info("socket").fileno(), socket.AF_UNIX, socket.SOCK_STREAM
            )
            raw.setblocking(True)
            socket.send_fds(raw, [json.dumps({"ok": True}).encode() + b"\n"], [theirs.fileno()])
            raw.close()
        finally:
            theirs.close()
            writer.close()
        r, w = await asyncio.open_connection(sock=ours)

        from umbra.attest.atls import relay

        try:
            await relay(session.conn, r, w)
        finally:
            await session.conn.close()
            w.close()


async def serve(path: Path) -> None:
    agent = Agent()
    with contextlib.suppress(FileNotFoundError):
        await asyncio.to_thread(path.unlink)
    server = await asyncio.start_unix_server(agent.handle, path=str(path))
    os.chmod(path, 0o600)
    await asyncio.to_thread(path.with_suffix(".pid").write_text, f"{os.getpid()}\n")
    async with server:
        while await asyncio.to_thread(path.exists):
            await asyncio.sleep(2)
            idle = asyncio.get_running_loop().time() - agent.last
            if agent.active == 0 and idle > IDLE_EXIT:
                break
    for leftover in (path, path.with_suffix(".pid")):
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(leftover.unlink)


def main() -> None:
    asyncio.run(serve(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
