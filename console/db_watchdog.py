"""A frozen PostgreSQL answers 503 within seconds, not after minutes of waiting.

A stopped (SIGSTOP), hung or unreachable server whose kernel still acknowledges TCP sends no error
and no reply: the server-side `statement_timeout` cannot fire, keepalives see a live peer, and
every request blocks on its socket. So each Console process probes the server on its own
connection every `DB_PROBE_INTERVAL_SECONDS`; a probe without an answer within
`DB_UNRESPONSIVE_SECONDS` declares the database unresponsive:

- every connection the engine has open is cut (its socket shut down), so a statement blocked on
  the frozen server fails at once (OperationalError → 503 + Retry-After) and the pool discards
  the connection;
- new connections are refused at once (the pool's reconnects included), and
  `Console.session()`/`write()` refuse at once with `DatabaseUnavailable` (503 + Retry-After)
  until a probe answers again, when requests are served again (pre-ping reconnects the pool).

Live but slow statements are untouched: the probe's `SELECT 1` still answers while they run, and
the server's own `statement_timeout` bounds them. New connections time out by `connect_timeout`,
and a peer that vanished is found by TCP keepalives (db.make_engine).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

import psycopg
from sqlalchemy import Engine, event

log = logging.getLogger("umbra.console.db")


def cut(connection: Any) -> None:
    """Shut the connection's socket down under whoever is blocked reading it."""
    try:
        fd = connection.pgconn.socket
        duplicate = socket.socket(fileno=os.dup(fd))
    except (OSError, psycopg.Error, AttributeError):
        return  # already closed
    try:
        duplicate.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        duplicate.close()


class DatabaseWatchdog:
    def __init__(self, engine: Engine, *, interval: float, deadline: float) -> None:
        self._dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._interval, self._deadline = interval, deadline
        self._connections: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._down = threading.Event()
        self._stop = threading.Event()
        self._probe_connection: psycopg.Connection[Any] | None = None
        self._thread: threading.Thread | None = None
        event.listen(engine, "connect", self._track)
        event.listen(engine, "do_connect", self._refuse_while_down)

    @property
    def down(self) -> bool:
        return self._down.is_set()

    def _refuse_while_down(self, *_args: Any) -> None:
        # The pool's reconnect (after a cut or a failed pre-ping) must not wait out a
        # connect_timeout against a server known not to answer.
        if self.down:
            raise psycopg.OperationalError("the database is not answering (watchdog)")

    def _track(self, dbapi_connection: Any, _record: Any) -> None:
        with self._lock:
            self._connections.add(dbapi_connection)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="umbra-db-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._probe_connection is not None:
            cut(self._probe_connection)
        if self._thread is not None:
            self._thread.join(timeout=self._deadline + 2)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            answered = self.probe()
            if answered and self.down:
                log.warning("database answers again")
                self._down.clear()
            elif not answered and not self.down and not self._stop.is_set():
                log.error(
                    "database did not answer within %.1f s: requests get 503 until it does",
                    self._deadline,
                )
                self._down.set()
                self.cut_all()

    def cut_all(self) -> None:
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            cut(connection)

    def probe(self) -> bool:
        """Whether the server answered within the deadline, on the probe's own connection: with
        `SELECT 1`'s result or with an error (a refused or terminated connection is an answer;
        requests get their own fast error then, and must not be refused for it)."""
        started = time.monotonic()
        timed_out = threading.Event()
        try:
            if self._probe_connection is None or self._probe_connection.closed:
                self._probe_connection = psycopg.connect(
                    self._dsn, autocommit=True, connect_timeout=max(2, round(self._deadline))
                )
            connection = self._probe_connection

            def expire() -> None:
                timed_out.set()
                cut(connection)

            timer = threading.Timer(self._deadline, expire)
            timer.start()
            try:
                connection.execute("SELECT 1")
            finally:
                timer.cancel()
            return True
        except psycopg.Error:
            if self._probe_connection is not None:
                self._probe_connection.close()
            self._probe_connection = None
            return not timed_out.is_set() and time.monotonic() - started < self._deadline
