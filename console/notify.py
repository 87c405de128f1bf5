"""Wakes long polls when something they watch changes in this process.

Writers call `notify()` from worker threads after commit; waiting coroutines wake at once. Other
Console replicas are covered by the long poll rechecking the database every interval (<= 1 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class ChangeNotifier:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def notify(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # the waiter's loop has closed
                loop.call_soon_threadsafe(event.set)

    async def wait(self, seconds: float) -> None:
        """Return on the next notification or after `seconds`, whichever is first."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        entry = (loop, event)
        with self._lock:
            self._waiters.add(entry)
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.discard(entry)
