"""Engine creation and the Alembic runner; one engine per app, sessions per request."""

from __future__ import annotations

import functools
import re
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import SQLAlchemyError

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def make_engine(
    url: str, *, statement_timeout_ms: int = 0, connect_timeout_s: int = 3, **kwargs: Any
) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs
        )

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    connect_args = kwargs.setdefault("connect_args", {})
    if statement_timeout_ms:
        # Set per connection by the server at login: no query can hold a connection longer.
        connect_args["options"] = f"-c statement_timeout={int(statement_timeout_ms)}"
    # A server that never answers the login fails the connect; a peer that vanished (no RST) is
    # found by keepalives within ~20 s. A frozen server is db_watchdog.py's job.
    connect_args.setdefault("connect_timeout", connect_timeout_s)
    connect_args.setdefault("keepalives", 1)
    connect_args.setdefault("keepalives_idle", 10)
    connect_args.setdefault("keepalives_interval", 3)
    connect_args.setdefault("keepalives_count", 3)
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20, **kwargs)


_PARTITION = re.compile(r"^traffic_record_(p\d{8}|default)$")


def include_name(name: str | None, type_: str, _parents: object) -> bool:
    """Alembic's autogenerate filter: the traffic table's partitions (console/traffic_partitions.py)
    are made at run time, not by the models, so a schema comparison leaves them out."""
    return not (type_ == "table" and name is not None and _PARTITION.match(name))


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation: a literal '%' in a password must be doubled.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


@functools.cache
def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    if head is None:
        raise RuntimeError("the Console has no migrations")
    return head


def revisions() -> list[str]:
    """Every revision, oldest first."""
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def not_ready(engine: Engine) -> str | None:
    """Why the database cannot serve this build (it does not answer, or is not migrated to this
    build's head); None when it can."""
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        revision = current_revision(engine)
    except SQLAlchemyError:
        return "database unavailable"
    if revision != head_revision():
        return f"database at revision {revision}, expected {head_revision()}"
    return None


def as_utc(value: datetime) -> datetime:
    """SQLite drops the offset of stored times; every time the Console stores is UTC."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class WriteGate:
    """Serializes write transactions on SQLite (one writer; avoids stale-snapshot upgrade failures
    in WAL mode). PostgreSQL handles concurrent writers itself, so there the gate is open."""

    def __init__(self, serialize: bool) -> None:
        self._lock: threading.Lock | None = threading.Lock() if serialize else None

    def __enter__(self) -> None:
        if self._lock is not None:
            self._lock.acquire()

    def __exit__(self, *_exc: object) -> None:
        if self._lock is not None:
            self._lock.release()
