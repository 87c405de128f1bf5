"""`ProxyThread`: an `UmbraProxy` run in-process on its own event loop in a background thread, so
a test can reach into the running proxy (its state, spool, tunnel endpoint) or inject a failing
dependency. Test-only; production runs `umbra proxy serve`."""

from __future__ import annotations

import asyncio
import threading

from umbra.proxy.config import ProxyConfig
from umbra.proxy.runner import UmbraProxy
from umbra.proxy.startup import StartupError


class ProxyThread:
    """Runs an UmbraProxy on its own event loop in a background thread (for tests)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.proxy = UmbraProxy(config)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="umbra-proxy", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self.proxy.run())
        except BaseException as exc:
            self._error = exc
            self.proxy.mark_ready()

    def start(self, timeout: float = 30) -> int:
        self._thread.start()
        if not self.proxy.wait_ready(timeout) or self.proxy.listen_port is None:
            raise StartupError(f"proxy did not start: {self._error!r}")
        return self.proxy.listen_port

    def stop(self) -> None:
        self.proxy.shutdown()
        self._thread.join(timeout=15)
