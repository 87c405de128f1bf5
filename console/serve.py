"""Running the Console under uvicorn (`umbra console serve`), with one or more worker processes."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from uvicorn.supervisors import Multiprocess

from umbra.console import db
from umbra.console.app import create_app
from umbra.console.config import ConfigError, Settings
from umbra.console.http_guard import GuardedH11Protocol

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
    _install_access_log_filter()
    return create_app(Settings.model_validate_json(raw), owns_process=True)


class DropQueryString(logging.Filter):
    """The access log keeps the path only: query strings can carry tokens or names."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], args[2].split("?", 1)[0], *args[3:])
        return True


def _install_access_log_filter() -> None:
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, DropQueryString) for f in logger.filters):
        logger.addFilter(DropQueryString())


def preflight(settings: Settings) -> None:
    """Refuse to start on what cannot work, with one line saying what to set."""
    if not settings.oidc_issuer:
        raise ConfigError(
            "oidc_issuer is not set: set UMBRA_CONSOLE_OIDC_ISSUER to your identity provider's "
            "issuer URL"
        )
    if settings.auto_migrate:
        db.upgrade(settings.database_url)
        return
    engine = db.make_engine(settings.database_url)
    try:
        current = db.current_revision(engine)
    except Exception as exc:
        raise ConfigError(
            f"database_url: cannot read the schema revision ({type(exc).__name__})"
        ) from None
    finally:
        engine.dispose()
    if current != db.head_revision():
        raise ConfigError(
            f"the database is at revision {current or 'none'}, this Console needs "
            f"{db.head_revision()}: run `umbra console migrate` or start with --migrate"
        )


def serve(
    settings: Settings,
    host: str,
    port: int,
    *,
    workers: int = 1,
    access_log: bool = True,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
) -> None:
    if workers < 1:
        raise ConfigError("workers: must be at least 1")
    if workers > 1 and settings.is_sqlite:
        raise ConfigError("workers: SQLite (the embedded default) is served by one worker")
    if workers > 1 and settings.web_session_key is None:
        # Each worker would key web cookies at random: a login on one is refused by the others.
        raise ConfigError(
            "workers: set UMBRA_CONSOLE_WEB_SESSION_KEY (base64 of 32 bytes) so every worker "
            "accepts the same web sessions"
        )
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("tls: give both --tls-cert and --tls-key, or neither")
    for path in (tls_cert, tls_key):
        if path is not None and not path.is_file():
            raise ConfigError(f"tls: {path} is not a readable file")
    preflight(settings)
    # Migrated once, here: workers must not race each other through Alembic.
    settings = settings.model_copy(update={"auto_migrate": False})
    _install_access_log_filter()
    sock = listening_socket(host, port)
    options: dict[str, object] = {
        "access_log": access_log,
        "proxy_headers": False,
        "server_header": False,
        "timeout_graceful_shutdown": 5,
        # Bounds the header section (431 and close) and the time to read it (close).
        "h11_max_incomplete_event_size": 32 << 10,
        "http": GuardedH11Protocol,
    }
    if tls_cert is not None and tls_key is not None:
        options.update(ssl_certfile=str(tls_cert), ssl_keyfile=str(tls_key))
    if workers == 1:
        config = uvicorn.Config(create_app(settings, owns_process=True), **options)  # type: ignore[arg-type]
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
