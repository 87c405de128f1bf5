"""Keys every Console replica shares, stored once in the database (`console_key`).

The first replica (or request) that needs a key inserts a random one with `ON CONFLICT DO
NOTHING` and everyone then reads the row that won, so N replicas agree without coordination.
Only MAC keys live here: leaking one lets a database reader mint enrollment nonces (freshness),
never a credential, which still needs a single-use token and a genuine quote.
"""

from __future__ import annotations

import secrets
from threading import Lock

from sqlalchemy import Engine, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlmodel import col

from umbra.console.models import ConsoleKey, utcnow

ENROLL_NONCE_KEY = "enroll-nonce"
KEY_BYTES = 32


class SharedKeys:
    """Per-process cache of the shared keys (they never change once created)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._keys: dict[str, bytes] = {}
        self._lock = Lock()

    def get(self, name: str) -> bytes:
        with self._lock:
            cached = self._keys.get(name)
            if cached is None:
                cached = self._keys[name] = load_or_create(self._engine, name)
            return cached


def load_or_create(engine: Engine, name: str) -> bytes:
    insert = pg_insert if engine.dialect.name == "postgresql" else sqlite_insert
    with engine.begin() as connection:
        connection.execute(
            insert(ConsoleKey)
            .values(name=name, secret=secrets.token_bytes(KEY_BYTES), created_at=utcnow())
            .on_conflict_do_nothing(index_elements=["name"])
        )
        stored: bytes = connection.execute(
            select(col(ConsoleKey.secret)).where(col(ConsoleKey.name) == name)
        ).scalar_one()
    return stored
