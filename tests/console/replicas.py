"""N Console replicas (separate processes) on one PostgreSQL behind a real load balancer (HAProxy
from Debian), for the scale-out test and the launch benchmark.

Each replica is `python -m tests.console.replicas SETTINGS_JSON PORT JOURNAL`: a Console built
from the settings with one more provider, `recorder` — a background, resumable stand-in for a
cloud that takes `delay` seconds per launch and appends `start`/`end` lines (cvm id, pid, time)
to a journal file shared by every replica (O_APPEND writes of one short line are atomic), so a
test can see which process ran which job and when.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.console.postgres import free_port
from umbra.console.providers import CvmSpec, OnProviderEvent, ProviderEvent, Provisioned

ROOT = Path(__file__).resolve().parents[2]
HAPROXY = "/usr/sbin/haproxy"


class RecorderProvider:
    """A cloud that answers after `delay` seconds and writes down every run it does."""

    name = "recorder"
    background = True
    resumable = True
    default_data_disk_gb: int | None = 64

    def __init__(self, journal: Path, delay: float) -> None:
        self.journal, self.delay = journal, delay

    def _note(self, event: str, cvm_id: str) -> None:
        line = f"{event} {cvm_id} {os.getpid()} {time.time():.6f}\n".encode()
        fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def check(self, spec: CvmSpec) -> None:
        return None

    def launch(self, spec: CvmSpec, on_event: OnProviderEvent) -> Provisioned:
        self._note("start", spec.id)
        on_event(ProviderEvent("started", "recorder launch"))
        time.sleep(self.delay)
        self._note("end", spec.id)
        return Provisioned(f"recorder:{spec.id}", {"pid": os.getpid()})

    def update(self, spec: CvmSpec, ref: str, on_event: OnProviderEvent) -> Provisioned:
        return Provisioned(ref)

    def set_running(self, ref: str, running: bool) -> None:
        return None

    def destroy(self, spec: CvmSpec, ref: str | None, on_event: OnProviderEvent) -> None:
        return None


@dataclass(frozen=True)
class Run:
    cvm_id: str
    pid: int
    start: float
    end: float | None  # None: never finished (its process was killed)


def read_journal(path: Path) -> dict[str, list[Run]]:
    starts: dict[tuple[str, int], list[float]] = defaultdict(list)
    runs: dict[str, list[Run]] = defaultdict(list)
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        event, cvm_id, pid, at = line.split()
        if event == "start":
            starts[(cvm_id, int(pid))].append(float(at))
        else:
            begun = starts[(cvm_id, int(pid))].pop(0)
            runs[cvm_id].append(Run(cvm_id, int(pid), begun, float(at)))
    for (cvm_id, pid), pending in starts.items():
        runs[cvm_id].extend(Run(cvm_id, pid, begun, None) for begun in pending)
    return runs


def _wait_http(url: str, deadline: float, process: subprocess.Popen[bytes] | None) -> None:
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({process.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer")
        time.sleep(0.1)


@dataclass
class Cluster:
    """`replicas` Console processes and HAProxy in front (round robin, health-checked)."""

    settings: dict[str, Any]
    workdir: Path
    replicas: int = 3
    delay: float = 1.0
    journal: Path = field(init=False)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    lb: subprocess.Popen[bytes] | None = None
    lb_port: int = 0

    def __post_init__(self) -> None:
        self.journal = self.workdir / "journal"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    def start(self) -> Cluster:
        config = self.workdir / "settings.json"
        config.write_text(json.dumps(self.settings))
        deadline = time.monotonic() + 60
        for index in range(self.replicas):
            port = free_port()
            log = (self.workdir / f"replica-{index}.log").open("wb")
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.console.replicas", str(config), str(port),
                 str(self.journal), str(self.delay)],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            self.processes.append(process)
            self.ports.append(port)
        for process, port in zip(self.processes, self.ports, strict=True):
            _wait_http(f"http://127.0.0.1:{port}/healthz", deadline, process)
        self.lb_port = free_port()
        cfg = self.workdir / "haproxy.cfg"
        servers = "\n".join(
            f"    server r{i} 127.0.0.1:{port} check inter 300ms fall 2 rise 2"
            for i, port in enumerate(self.ports)
        )
        # Long polls last up to 30 s; a connection refused by a dead replica is retried on
        # another one (`redispatch`), never a request that reached a replica (not idempotent).
        cfg.write_text(
            "global\n    maxconn 4096\n"
            "defaults\n    mode http\n    timeout connect 2s\n    timeout client 60s\n"
            "    timeout server 60s\n    retries 3\n    option redispatch 1\n"
            "    retry-on conn-failure\n"
            f"frontend console\n    bind 127.0.0.1:{self.lb_port}\n    default_backend replicas\n"
            "backend replicas\n    balance roundrobin\n    option httpchk GET /healthz\n"
            f"{servers}\n"
        )
        self.lb = subprocess.Popen(
            [HAPROXY, "-f", str(cfg), "-db"],
            stdout=(self.workdir / "haproxy.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        _wait_http(f"{self.url}/healthz", deadline, self.lb)
        return self

    def kill(self, index: int) -> int:
        """kill -9 one replica; returns its pid."""
        process = self.processes[index]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        return process.pid

    def stop(self) -> None:
        for process in [*self.processes, *([self.lb] if self.lb else [])]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in [*self.processes, *([self.lb] if self.lb else [])]:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


def _serve(settings_path: str, port: str, journal: str, delay: str) -> None:
    import uvicorn

    from umbra.console.app import create_app
    from umbra.console.config import Settings
    from umbra.console.serve import listening_socket

    settings = Settings.model_validate(json.loads(Path(settings_path).read_text()))
    app = create_app(settings, owns_process=True)
    app.state.console.providers["recorder"] = RecorderProvider(Path(journal), float(delay))
    sock: socket.socket = listening_socket("127.0.0.1", int(port))
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=5
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    threading.current_thread().name = "replica"
    _serve(*sys.argv[1:5])
