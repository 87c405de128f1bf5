"""Write-only secrets: no response, log line or database byte ever holds a value in plaintext."""

from __future__ import annotations

import base64
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.console.helpers import CaptureHandler, Server, Team
from tests.console.postgres import PostgresServer
from umbra.console.envelope import (
    EnvelopeError,
    LocalKeyring,
    Sealed,
    open_sealed,
    seal,
    secret_aad,
)


def encodings(value: str) -> list[bytes]:
    raw = value.encode()
    return [raw, base64.b64encode(raw), raw.hex().encode(), base64.urlsafe_b64encode(raw)]


def database_bytes(server: Server, request: pytest.FixtureRequest) -> Iterator[bytes]:
    if server.sqlite_path is not None:
        for path in server.sqlite_path.parent.iterdir():  # the db, its -wal and -shm
            yield path.read_bytes()
        return
    postgres: PostgresServer = request.getfixturevalue("postgres")
    with psycopg.connect(postgres.admin_dsn, autocommit=True) as connection:
        connection.execute("CHECKPOINT")
    for path in Path(postgres.data).rglob("*"):
        if path.is_file():
            yield path.read_bytes()


@pytest.fixture
def sql_logging() -> Iterator[None]:
    engine_logger = logging.getLogger("sqlalchemy.engine")
    previous = engine_logger.level
    engine_logger.setLevel(logging.INFO)  # statements and parameters go to the captured log
    yield
    engine_logger.setLevel(previous)


def test_secret_values_never_leave_in_plaintext(
    server: Server,
    team: Team,
    log_capture: CaptureHandler,
    request: pytest.FixtureRequest,
    sql_logging: None,
) -> None:
    team_value = "team-" + uuid.uuid4().hex
    personal_value = "personal-" + uuid.uuid4().hex
    base = f"/api/v1/teams/{team.name}"
    team.upload(1)
    set_team = team.admin.put(
        f"{base}/secrets/bot", json={"value": team_value, "hosts": ["API.Example.com."]}
    )
    assert set_team.status_code == 200
    assert set_team.json() == {
        "team": team.name,
        "scope": "team",
        "owner": None,
        "name": "bot",
        "ref": "team/bot",
        "hosts": ["api.example.com"],
        "version": 1,
        "kind": "static",
        "status": "ok",
        "updated_by": team.admin_subject,
        "updated_at": set_team.json()["updated_at"],
    }
    again = team.admin.put(f"{base}/secrets/bot", json={"value": team_value + "2"})
    assert again.json()["version"] == 2
    personal = team.dev.put(
        f"{base}/personal-secrets/github", json={"value": personal_value, "hosts": ["github.com"]}
    )
    assert personal.status_code == 200
    assert personal.json()["owner"] == team.dev_subject
    # Rejected input never echoes the value back.
    assert (
        team.admin.put(f"{base}/secrets/x", json={"value": team_value, "extra": 1}).status_code
        == 422
    )
    assert (
        team.dev.put(f"{base}/personal-secrets/x", json={"value": personal_value}).status_code
        == 422
    )
    assert team.admin.put(f"{base}/secrets/x", json={"value": team_value * 2000}).status_code == 422
    assert team.admin.put(f"{base}/secrets/Bad Name", json={"value": team_value}).status_code in (
        404,
        422,
    )
    # Read everything there is to read.
    for client in (team.admin, team.dev):
        for path in ("/secrets", "/personal-secrets", "/audit", "/cvms", "/traffic", "/bundles"):
            client.get(base + path)
    team.dev.get("/api/v1/me")
    team.scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments")
    team.scvm.get("/metrics")
    listed = team.dev.get(f"{base}/secrets").json()
    assert [(item["ref"], item["version"]) for item in listed] == [("team/bot", 2)]
    assert [item["ref"] for item in team.dev.get(f"{base}/personal-secrets").json()] == [
        "personal/github"
    ]
    assert team.admin.get(f"{base}/personal-secrets").json() == []  # admins do not see others'

    responses = b"\n".join(server.responses)
    logs = log_capture.text().encode()
    database = list(database_bytes(server, request))
    assert sum(len(chunk) for chunk in database) > 0
    assert b"INSERT INTO secret" in logs  # the capture sees SQL statements and parameters
    for value in (team_value, team_value + "2", personal_value):
        for form in encodings(value):
            assert form not in responses
            assert form not in logs
            for chunk in database:
                assert form not in chunk


def test_deleted_secret_is_gone(team: Team) -> None:
    base = f"/api/v1/teams/{team.name}"
    assert team.admin.put(f"{base}/secrets/gone", json={"value": "v"}).status_code == 200
    assert team.admin.delete(f"{base}/secrets/gone").status_code == 204
    assert team.admin.delete(f"{base}/secrets/gone").status_code == 404
    assert team.admin.get(f"{base}/secrets").json() == []


def test_envelope_binds_ciphertext_to_its_secret() -> None:
    keyring = LocalKeyring({"k1": os.urandom(32)}, "k1")
    aad_a = secret_aad("t", "team", "", "a", 1)
    aad_b = secret_aad("t", "team", "", "b", 1)
    sealed = seal(keyring, b"value-a", aad_a)
    assert open_sealed(keyring, sealed, aad_a) == b"value-a"
    with pytest.raises(EnvelopeError):
        open_sealed(keyring, sealed, aad_b)  # moved to another row
    flipped = Sealed(sealed.kek_id, sealed.wrapped_key, sealed.ciphertext[:-1] + b"\x00")
    with pytest.raises(EnvelopeError):
        open_sealed(keyring, flipped, aad_a)
    other = LocalKeyring({"k1": os.urandom(32)}, "k1")
    with pytest.raises(EnvelopeError):
        open_sealed(other, sealed, aad_a)  # wrong KEK
    rotated = LocalKeyring({"k1": keyring._keys["k1"], "k2": os.urandom(32)}, "k2")
    assert open_sealed(rotated, sealed, aad_a) == b"value-a"  # old KEK still unwraps
    assert seal(rotated, b"x", aad_a).kek_id == "k2"
