"""Asks Codex for its account the way its interactive UI does: `codex app-server` (the JSON-RPC
server behind `codex`'s TUI) answers `account/read`, and with a ChatGPT login that runs Codex's
workspace routing discovery (`GET /backend-api/wham/accounts/check`) first.

Standard library only, so it runs as is on this host and inside the sandbox (`python3 -`, the
source on stdin). Prints the `account/read` answer (one JSON line) and exits 0, or says what went
wrong and exits 1; never waits more than DEADLINE seconds.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from typing import Any

DEADLINE = 60.0


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _answer(lines: queue.Queue[str | None], wanted: int, end: float) -> dict[str, Any]:
    """The reply to request `wanted`; notifications in between are skipped."""
    while True:
        try:
            line = lines.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"no answer to request {wanted} within {DEADLINE:.0f} s") from None
        if line is None:
            raise EOFError(f"codex app-server exited before answering request {wanted}")
        message: dict[str, Any] = json.loads(line)
        if message.get("id") == wanted:
            return message


def main() -> int:
    end = time.monotonic() + DEADLINE
    server = subprocess.Popen(
        ["codex", "app-server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdin is not None and server.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(server.stdout, lines), daemon=True).start()

    def send(message: dict[str, Any]) -> None:
        assert server.stdin is not None
        server.stdin.write(json.dumps(message) + "\n")
        server.stdin.flush()

    try:
        client = {"name": "umbra_test", "title": "umbra test", "version": "0.1"}
        send({"method": "initialize", "id": 0, "params": {"clientInfo": client}})
        _answer(lines, 0, end)
        send({"method": "initialized"})
        send({"method": "account/read", "id": 1, "params": {"refreshToken": False}})
        answer = _answer(lines, 1, end)
    except (TimeoutError, EOFError) as exc:
        print(f"account/read: {exc}", file=sys.stderr)
        return 1
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    print(json.dumps(answer))
    return 0 if "result" in answer else 1


if __name__ == "__main__":
    sys.exit(main())
