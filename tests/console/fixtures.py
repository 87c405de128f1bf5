"""Session-wide servers several test packages share: one OIDC issuer and one PostgreSQL.

Loaded for the whole suite by `tests/conftest.py`, so a run starts each of them once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.console.oidc_issuer import LocalIssuer
from tests.console.postgres import PostgresServer, find_bindir


@pytest.fixture(scope="session")
def issuer() -> Iterator[LocalIssuer]:
    server = LocalIssuer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    bindir = find_bindir()
    if bindir is None:
        pytest.fail("PostgreSQL binaries not found: run scripts/system-deps (apt `postgresql`)")
    server = PostgresServer(bindir)
    server.start()
    yield server
    server.stop()
