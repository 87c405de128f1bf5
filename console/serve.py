"""Running the Console under uvicorn (`umbra console serve`), with one or more worker processes."""

from __future__ import annotations

import os
import socket

import uvicorn
from fastapi import FastAPI
from uvicorn.supervisors import Multiprocess

from umbra.console.app import create_app
from umbra.console.config import ConfigError, Settings

# Worker processes rebuild the parent's validated settings from this variable (same trust as the
# environment the parent read them from).
SETTINGS_ENV = "UMBRA_CONSOLE__WORKER_SETTINGS"


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket with TCP_NODELAY, which accepted connections inherit: without it a
    response written in two parts waits ~40 ms for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def worker_app() -> FastAPI:
    """uvicorn factory for worker processes."""
    raw = os.environ.get(SETTINGS_ENV)
    if raw is None:
        raise ConfigError(f"{SETTINGS_ENV} is not set; start workers with `umbra console serve`")
    return create_app(Settings.model_validate_json(raw))


def serve(
    settings: Settings, host: str, port: int, *, workers: int = 1, access_log: bool = True
) -> None:
    if workers < 1:
        raise ConfigError("workers: must be at least 1")
    if workers > 1 and settings.is_sqlite:
        raise ConfigError("workers: SQLite (the embedded default) is served by one worker")
    sock = listening_socket(host, port)
    options = {
        "access_log": access_log,
        "proxy_headers": False,
        "server_header": False,
        "timeout_graceful_shutdown": 5,
    }
    if workers == 1:
        config = uvicorn.Config(create_app(settings), **options)  # type: ignore[arg-type]
        uvicorn.Server(config).run(sockets=[sock])
        return
    os.environ[SETTINGS_ENV] = settings.model_dump_json()
    config = uvicorn.Config(
        "umbra.console.serve:worker_app",
        factory=True,
        workers=workers,
        **options,  # type: ignore[arg-type]
    )
    Multiprocess(config, sockets=[sock]).run()
