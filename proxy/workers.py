"""`umbra proxy serve --workers N`: a supervisor and N worker processes on one port.

The supervisor creates the interception CA once, starts the workers (each an `UmbraProxy` with its
own policy puller, secret puller and spool; configuration on stdin) and relays their output. Fails
closed: if any worker exits, all are stopped.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading

from umbra.proxy.config import ProxyConfig
from umbra.proxy.runner import UmbraProxy
from umbra.proxy.startup import StartupError


class WorkerSupervisor:
    """`--workers N`: N proxy processes on one port (SO_REUSEPORT), each pulling policy and
    secrets and spooling on its own. Fails closed: if any worker exits, all are stopped."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._workers: list[subprocess.Popen[bytes]] = []

    def _start(self, index: int) -> subprocess.Popen[bytes]:
        worker = self.config.model_copy(update={"worker_index": index})
        process = subprocess.Popen(
            [sys.executable, "-c", "from umbra.proxy.workers import worker_main; worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert process.stdin is not None
        process.stdin.write(worker.model_dump_json().encode())
        process.stdin.close()
        return process

    def run(self) -> int:
        config = self.config
        ready = threading.Semaphore(0)

        def relay(process: subprocess.Popen[bytes]) -> None:
            assert process.stdout is not None
            for line in process.stdout:
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                if line.startswith(b"umbra worker ") and b" listening on " in line:
                    ready.release()

        stopping = threading.Event()

        def stop(_signum: int, _frame: object) -> None:
            stopping.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stop)
        # Create the interception CA once, before the workers race to create one each.
        from mitmproxy.certs import CertStore

        config.confdir.mkdir(parents=True, exist_ok=True)
        CertStore.from_store(config.confdir, "mitmproxy", 2048)
        try:
            for index in range(config.workers):
                process = self._start(index)
                self._workers.append(process)
                threading.Thread(target=relay, args=(process,), daemon=True).start()
            for _ in range(config.workers):
                while not ready.acquire(timeout=0.2):
                    if stopping.is_set() or any(p.poll() is not None for p in self._workers):
                        raise StartupError("a proxy worker did not start")
            print(
                f"umbra proxy listening on {config.listen_host}:{config.listen_port} "
                f"({config.workers} workers)",
                flush=True,
            )
            while not stopping.is_set():
                if any(p.poll() is not None for p in self._workers):
                    print("umbra proxy: a worker exited; stopping all", file=sys.stderr)
                    return 1
                stopping.wait(0.2)
            return 0
        finally:
            for process in self._workers:
                if process.poll() is None:
                    process.terminate()
            for process in self._workers:
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()


def worker_main() -> None:
    """Entry point of one worker process: its configuration arrives on stdin."""
    config = ProxyConfig.model_validate_json(sys.stdin.buffer.read())
    try:
        asyncio.run(UmbraProxy(config).run())
    except StartupError as exc:
        print(f"umbra proxy worker {config.worker_index}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        pass
