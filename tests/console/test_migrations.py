"""Alembic: upgrade from empty and from every earlier revision reaches a schema equal to the models."""

from __future__ import annotations

import pytest
import sqlalchemy
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlmodel import SQLModel

import umbra.console.models  # noqa: F401
from tests.console.conftest import BACKENDS, new_database
from umbra.console import db


def _schema_diff(url: str) -> list[object]:
    engine = db.make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"include_name": db.include_name})
            return list(compare_metadata(context, SQLModel.metadata))
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("start", ["base", *db.revisions()])
def test_upgrade_reaches_the_models(
    backend: str, start: str, request: pytest.FixtureRequest
) -> None:
    url, _path = new_database(backend, request)
    if start != "base":
        db.upgrade(url, start)
    db.upgrade(url, "head")
    engine = db.make_engine(url)
    try:
        assert db.current_revision(engine) == db.head_revision()
    finally:
        engine.dispose()
    assert _schema_diff(url) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_downgrade_to_base_and_back(backend: str, request: pytest.FixtureRequest) -> None:
    url, _path = new_database(backend, request)
    db.upgrade(url, "head")
    db.downgrade(url, "base")
    db.upgrade(url, "head")
    assert _schema_diff(url) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_survive_upgrade_from_0001(backend: str, request: pytest.FixtureRequest) -> None:
    url, _path = new_database(backend, request)
    db.upgrade(url, "0001")
    engine = db.make_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(
                sqlalchemy.text(
                    "INSERT INTO traffic_record (id, security_cvm_id, time, team, query_keys, "
                    "decision, bytes_sent, bytes_received, duration_ms, scan_rule_ids, "
                    "injected_headers, received_at) VALUES ('r1', 's', :t, 'team', '[]', 'allow', "
                    "0, 0, 0, '[]', '[]', :t)"
                ),
                {"t": "2026-01-01 00:00:00.000000+00:00"},
            )
        db.upgrade(url, "head")
        with engine.connect() as connection:
            row = connection.execute(
                sqlalchemy.text("SELECT kind, detail FROM traffic_record WHERE id = 'r1'")
            ).one()
        assert tuple(row) == ("http", None)
    finally:
        engine.dispose()
