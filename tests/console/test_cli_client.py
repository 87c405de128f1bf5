"""The client commands (`umbra auth|secret|cvm|logs`) driven with typer's CliRunner against a
running Console (real OIDC issuer, SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from typer.testing import CliRunner, Result

from tests.console.helpers import Server, Team, traffic_record, unique
from tests.console.oidc_issuer import LocalIssuer
from umbra.cli.app import app

SECRET = "cli-secret-Zq8X1w9Vt3"


class Cli:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.runner = CliRunner()
        self.outputs: list[str] = []

    def __call__(self, *args: str, input: str | None = None, code: int = 0) -> Result:
        result = self.runner.invoke(
            app, list(args), input=input, env={"XDG_CONFIG_HOME": str(self.home), "COLUMNS": "200"}
        )
        self.outputs.append(result.output)
        assert result.exit_code == code, (args, result.exit_code, result.output)
        return result

    def json(self, *args: str, code: int = 0) -> Any:
        return json.loads(self(*args, "--json", code=code).stdout)


def token_of(client: Any) -> str:
    return str(client.headers["Authorization"].removeprefix("Bearer "))


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_cli_client_commands(server: Server, team: Team, tmp_path: Path) -> None:
    admin, dev = Cli(tmp_path / "admin"), Cli(tmp_path / "dev")
    token_file = tmp_path / "token"
    token_file.write_text(token_of(team.admin) + "\n")
    login = admin("auth", "login", server.url, "--token-file", str(token_file), "--team", team.name)
    assert team.admin_subject in login.output
    stored = tmp_path / "admin" / "umbra" / "console.json"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert stat.S_IMODE(stored.parent.stat().st_mode) == 0o700
    # The developer logs in from stdin and has one team, so no --team is needed anywhere.
    dev("auth", "login", server.url, "--token-file", "-", input=token_of(team.dev))
    assert dev.json("auth", "status")["subject"] == team.dev_subject
    refused = Cli(tmp_path / "nobody")
    refused("auth", "login", server.url, input="not-a-token", code=1)
    assert not (tmp_path / "nobody" / "umbra" / "console.json").exists()
    refused("cvm", "list", code=2)

    # Secrets: the value goes in on stdin and comes back nowhere.
    out = dev("secret", "set", "gh", "--host", "GitHub.com", "--personal", input=SECRET + "\n")
    assert "personal/gh" in out.output and "github.com" in out.output
    admin("secret", "set", "bot", "--host", "api.example.com", input=SECRET)
    denied = dev("secret", "set", "bot", "--host", "api.example.com", input=SECRET, code=1)
    assert "403" in denied.output
    dev("secret", "set", "gh", input=SECRET, code=2)  # --host is required
    listed = dev.json("secret", "list")
    assert {(s["ref"], tuple(s["hosts"])) for s in listed} == {
        ("team/bot", ("api.example.com",)),
        ("personal/gh", ("github.com",)),
    }
    assert "personal/gh" in dev("secret", "list").output

    # CVMs (the local provider).
    cvm = dev.json("cvm", "launch", "box", "--security-cvm", team.scvm_id)
    assert cvm["state"] == "running" and cvm["owner"] == team.dev_subject
    assert "box" in dev("cvm", "list").output
    assert [c["name"] for c in admin.json("cvm", "list")] == ["sec", "box"]
    assert dev.json("cvm", "update", cvm["id"], "--state", "stopped")["state"] == "stopped"
    dev("cvm", "update", cvm["id"], code=2)
    taken = dev("cvm", "launch", "box", code=1)
    assert "409" in taken.output
    security = admin.json("cvm", "launch", "sec2", "--kind", "security")
    assert "credential" not in security  # only enrollment issues it, after attestation
    minted = admin.json("cvm", "enrollment-token", security["id"])
    assert minted["cvm_id"] == security["id"] and minted["token"].startswith("enr_")
    assert minted["token"] not in str(admin.json("cvm", "list"))
    dev("cvm", "enrollment-token", security["id"], code=1)  # admins only (404 to others)

    # Traffic log queries.
    records = [
        traffic_record(team.name, cvm_id=cvm["id"], owner=team.dev_subject),
        traffic_record(
            team.name,
            cvm_id=cvm["id"],
            owner=team.dev_subject,
            host="evil.example",
            decision="deny",
            rule_id=None,
            reason="no_matching_rule",
        ),
        traffic_record(team.name, host="example.com"),
    ]
    assert team.scvm.post("/api/v1/traffic/batches", json={"records": records}).status_code == 200
    denies = dev.json("logs", "--cvm", cvm["id"], "--decision", "deny")
    assert [r["id"] for r in denies] == [records[1]["id"]]
    assert len(admin.json("logs", "--since", "1h")) == 3
    assert (
        admin.json("logs", "--since", "2000-01-01T00:00:00", "--host", "example.com")[0]["id"]
        == (records[2]["id"])
    )
    table = admin("logs", "--host", "evil.example").output
    assert "evil.example" in table and "deny" in table
    admin("logs", "--since", "yesterday", code=2)

    assert dev.json("cvm", "destroy", cvm["id"], "--yes")["state"] == "destroyed"
    dev("cvm", "update", cvm["id"], "--state", "running", code=1)

    # The secret appears in no output and no file the CLI wrote; the tokens are never printed.
    everything = "\n".join(admin.outputs + dev.outputs + refused.outputs)
    assert SECRET not in everything
    assert token_of(team.admin) not in everything and token_of(team.dev) not in everything
    for path in files_under(tmp_path):
        assert SECRET.encode() not in path.read_bytes(), path
    if server.sqlite_path is not None:  # only ciphertext in the Console's store
        for path in server.sqlite_path.parent.glob("console.db*"):
            assert SECRET.encode() not in path.read_bytes()


def test_cli_client_device_login(
    server: Server, issuer: LocalIssuer, team: Team, tmp_path: Path
) -> None:
    cli = Cli(tmp_path)
    subject = unique("dev")
    issuer.device_grant, issuer.device_polls = (subject, [f"{team.name}:developer"]), 0
    try:
        result = cli("auth", "login", server.url, "--issuer", issuer.url)
    finally:
        issuer.device_grant = None
    assert "WDJB-MJHT" in result.output and subject in result.output
    assert issuer.device_polls == 2
    stored = json.loads((tmp_path / "umbra" / "console.json").read_text())
    assert stored["token"] not in result.output
    assert cli.json("auth", "status")["roles"] == {team.name: "developer"}
    cli("auth", "logout")
    cli("auth", "status", code=2)
