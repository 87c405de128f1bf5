"""Fixtures: a real OIDC issuer, a throwaway PostgreSQL, and one Console per database backend."""

from __future__ import annotations

import logging
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from tests.console.helpers import CaptureHandler, Server, Team, new_team, start_server
from tests.console.oidc_issuer import LocalIssuer
from tests.console.postgres import PostgresServer
from umbra.console import db
from umbra.policy.bundle import generate_key

BACKENDS = ["sqlite", "postgresql"]
CAPTURED_LOGGERS = (
    "umbra", "uvicorn", "httpx", "httpcore", "alembic", "fastapi", "starlette",
    "asyncio", "psycopg", "joserfc", "prometheus_client",
)  # fmt: skip


@pytest.fixture(scope="session")
def log_capture() -> Iterator[CaptureHandler]:
    # Everything the Console process logs at INFO and above lands here (the secret-leak tests search
    # it); levels are raised only on the loggers the Console and its libraries use, not on root.
    # SQL statement logging is switched on by the tests that want it (`sql_logging`).
    handler = CaptureHandler()
    root = logging.getLogger()
    root.addHandler(handler)
    previous = {}
    for name in CAPTURED_LOGGERS:
        logger = logging.getLogger(name)
        previous[name] = logger.level
        logger.setLevel(logging.INFO)
    yield handler
    root.removeHandler(handler)
    for name, level in previous.items():
        logging.getLogger(name).setLevel(level)


def new_database(backend: str, request: pytest.FixtureRequest) -> tuple[str, Path | None]:
    if backend == "sqlite":
        path = Path(tempfile.mkdtemp(prefix="umbra-console-")) / "console.db"
        return f"sqlite:///{path}", path
    postgres: PostgresServer = request.getfixturevalue("postgres")
    return postgres.create_database("c_" + uuid.uuid4().hex[:12]), None


@pytest.fixture(params=BACKENDS)
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    """An engine on a fresh database at the head revision, on each backend."""
    url, _ = new_database(request.param, request)
    db.upgrade(url)
    engine = db.make_engine(url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session", params=BACKENDS)
def server(
    request: pytest.FixtureRequest,
    issuer: LocalIssuer,
    log_capture: CaptureHandler,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    backend: str = request.param
    url, sqlite_path = new_database(backend, request)
    running = start_server(
        backend,
        url,
        sqlite_path,
        issuer.url,
        generate_key(),
        tmp_path_factory.mktemp(f"console-{backend}"),
    )
    yield running
    running.stop()


@pytest.fixture
def team(server: Server, issuer: LocalIssuer) -> Iterator[Team]:
    created = new_team(server, issuer)
    yield created
    created.close()
