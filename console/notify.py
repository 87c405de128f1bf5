"""Wakes long polls when something they watch changes in this process.

Writers call `notify()` from worker threads after commit; waiting coroutines wake at once. Other
Console replicas are covered by the long poll rechecking the database every interval (<= 1 s).

At SIGTERM/SIGINT (`chain_exit_signals`, installed when the Console owns its process) every
notifier in the process enters shutdown: waiting long polls wake and answer what they hold (304
with the ETag the caller sent, or the current document) instead of being cancelled by the
server's graceful-shutdown deadline, which answered 500 with a traceback each.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import weakref
from types import FrameType
from typing import Any

_NOTIFIERS: weakref.WeakSet[ChangeNotifier] = weakref.WeakSet()
_SHUTTING_DOWN = threading.Event()


class ChangeNotifier:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._stopping = threading.Event()
        _NOTIFIERS.add(self)
        if _SHUTTING_DOWN.is_set():
            self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Shutdown has begun: wake every waiter now, and make later waits return at once."""
        self._stopping.set()
        self.notify()

    def notify(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # the waiter's loop has closed
                loop.call_soon_threadsafe(event.set)

    async def wait(self, seconds: float) -> None:
        """Return on the next notification or after `seconds`, whichever is first."""
        if self._stopping.is_set():
            return
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


def begin_shutdown() -> None:
    """Every notifier in this process enters shutdown (see the module's docstring)."""
    _SHUTTING_DOWN.set()
    for notifier in list(_NOTIFIERS):
        notifier.stop()


def chain_exit_signals() -> None:
    """Run `begin_shutdown` first on SIGTERM/SIGINT, then the handler already installed (the
    server's: uvicorn's graceful shutdown). Only the main thread can set signal handlers; a
    Console served from another thread (tests) is stopped by calling `begin_shutdown`."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)
        if not callable(previous) or getattr(previous, "_umbra_chained", False):
            continue

        def handler(signum: int, frame: FrameType | None, _previous: Any = previous) -> None:
            begin_shutdown()
            _previous(signum, frame)

        handler._umbra_chained = True  # type: ignore[attr-defined]
        signal.signal(sig, handler)
