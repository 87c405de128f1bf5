"""A Console unreachable at boot (issue 22, "Bad input, faults"): the CVM's enrollment client
retries with backoff and then fails naming its attempts; the Console, which never heard from the
CVM, marks it `failed` once its token expired unused, with the reason `umbra cvm list` shows; a
new token and a successful enrollment bring it back. Fails on the code before: no retry (one
attempt), and the CVM stayed `running` for ever with no reason."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update
from sqlmodel import col
from typer.testing import CliRunner

from tests.console import enroll
from tests.console.helpers import Team
from umbra.attest.enroll_client import BOOT_RETRY_DELAYS, ConsoleUnreachable, ensure_credential
from umbra.attest.simulator import SimulatedTdx
from umbra.console.enrollment import CvmEnrollment
from umbra.console.models import utcnow


def _token(team: Team, cvm_id: str, where: Path) -> Path:
    minted = team.admin.post(f"/api/v1/cvms/{cvm_id}/enrollment-token")
    assert minted.status_code == 201, minted.text
    path = where / f"{cvm_id}.token"
    path.write_text(minted.json()["token"])
    return path


def _expire_tokens(team: Team, cvm_id: str) -> None:
    with team.server.console.write() as session:
        session.execute(
            update(CvmEnrollment)
            .where(col(CvmEnrollment.cvm_id) == cvm_id)
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )


def _state(team: Team, cvm_id: str) -> tuple[str, str | None]:
    got = team.dev.get(f"/api/v1/cvms/{cvm_id}")
    assert got.status_code == 200, got.text
    return got.json()["state"], got.json().get("state_reason")


def test_boot_retries_with_backoff_then_names_the_attempts(tmp_path: Path) -> None:
    td = SimulatedTdx(enroll.pki(), image=enroll.DEV_IMAGE)
    token = tmp_path / "token"
    token.write_text("umbra_enroll_" + "x" * 40)
    slept: list[float] = []
    said: list[str] = []
    with pytest.raises(ConsoleUnreachable) as exc:
        ensure_credential(
            console_url="https://127.0.0.1:9",  # nothing listens: refused at once
            cvm_id="cvm_" + "ab" * 8,
            token_file=token,
            credential_file=tmp_path / "credential",
            quoter=lambda rd: (td.quote(rd), None),
            timeout=2,
            retry_delays=(0.5, 1.0, 2.0),
            say=said.append,
            sleep=slept.append,
        )
    assert slept == [0.5, 1.0, 2.0]
    assert "gave up after 4 attempts" in str(exc.value) and "Console unreachable" in str(exc.value)
    assert [line.split("attempt ")[1].split(",")[0] for line in said] == ["1/4", "2/4", "3/4"]
    assert token.read_text() not in str(exc.value) + "".join(said)  # the token never shown
    assert not (tmp_path / "credential").exists()
    # What the proxy and forwarder use at boot: doubling to a minute, well inside the token's hour.
    assert BOOT_RETRY_DELAYS[0] <= 2 and max(BOOT_RETRY_DELAYS) == 60
    assert 240 <= sum(BOOT_RETRY_DELAYS) <= 600


def test_a_cvm_that_never_reached_the_console_is_failed_with_the_reason_in_cvm_list(
    team: Team, tmp_path: Path
) -> None:
    lost, waiting = team.dev_cvm(), team.dev_cvm()
    _token(team, lost, tmp_path)
    _token(team, waiting, tmp_path)
    assert _state(team, lost) == ("running", None)
    _expire_tokens(team, lost)  # the hour passed with no word from it
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg"), "COLUMNS": "250"}
    runner = CliRunner()
    from umbra.cli.app import app

    bearer = str(team.dev.headers["Authorization"]).removeprefix("Bearer ")
    login = runner.invoke(app, ["auth", "login", team.server.url], input=bearer, env=env)
    assert login.exit_code == 0, login.output
    listed = runner.invoke(app, ["cvm", "list", "--team", team.name, "--json"], env=env)
    assert listed.exit_code == 0, listed.output
    rows = {row["id"]: row for row in json.loads(listed.stdout)}
    assert rows[lost]["state"] == "failed"
    assert "never reached the Console" in rows[lost]["state_reason"]
    assert rows[waiting]["state"] == "running"  # its token is still live: it may yet enroll
    table = runner.invoke(app, ["cvm", "list", "--team", team.name], env=env)
    assert "no_contact" in table.output, table.output
    # Reachable again: a new token and an attested enrollment bring it back to running.
    enroll.enroll(team.server.url, team.admin, lost, enroll.DEV_IMAGE, tmp_path)
    assert _state(team, lost) == ("running", None)
