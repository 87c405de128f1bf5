"""The admin's CLI against a running Console: policy publish, profile list/attach/detach, secret
rotate/delete, audit list/verify, logs filters/--follow/--quarantined at 80 columns, and a
`umbra --help` that imports no sub-command."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner, Result

from tests.console.helpers import Server, Team, standard_bundle, traffic_record
from umbra.cli.app import COMMANDS, SUBCOMMANDS, app

SECRET = "admin-cli-secret-7Hq2Lw0Pz"
ROTATED = "admin-cli-rotated-Vb5Nn1Kd8"


class Cli:
    def __init__(self, home: Path, columns: int = 200) -> None:
        self.env = {"XDG_CONFIG_HOME": str(home), "COLUMNS": str(columns)}
        self.runner = CliRunner()
        self.outputs: list[str] = []

    def __call__(self, *args: str, input: str | None = None, code: int = 0) -> Result:
        result = self.runner.invoke(app, list(args), input=input, env=self.env)
        self.outputs.append(result.output)
        assert result.exit_code == code, (args, result.exit_code, result.output)
        return result

    def json(self, *args: str, input: str | None = None, code: int = 0) -> Any:
        return json.loads(self(*args, "--json", input=input, code=code).stdout)


def test_admin_commands(
    server: Server, team: Team, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = Cli(tmp_path / "admin")
    token = str(team.admin.headers["Authorization"]).removeprefix("Bearer ")
    admin("auth", "login", server.url, "--token-file", "-", "--team", team.name, input=token)

    # Publish the signed bundle (what the release workflow runs), idempotently.
    bundle = tmp_path / "bundle.json"
    bundle.write_bytes(standard_bundle(server.bundle_key, 3))
    published = admin.json("policy", "publish", str(bundle))
    assert published["serial"] == 3
    assert admin.json("policy", "publish", str(bundle))["hash"] == published["hash"]

    # Profiles: attach and detach per Dev CVM; the Console checks composition.
    cvm = team.dev_cvm()
    assert admin.json("profile", "attach", cvm, "github", "web")["profiles"] == ["github", "web"]
    assert admin.json("profile", "detach", cvm, "web")["profiles"] == ["github"]
    clash = admin("profile", "attach", cvm, "clash-a", "clash-b", code=1)
    assert "422" in clash.output
    listed = admin.json("profile", "list")
    assert listed["serial"] == 3 and "clash-a" in listed["profiles"]
    assert listed["cvms"][cvm] == ["github"]

    # Secrets: rotate keeps the hosts and bumps the version; delete removes it.
    admin("secret", "set", "bot", "--host", "api.example.com", input=SECRET)
    rotated = admin.json("secret", "rotate", "bot", input=ROTATED)
    assert (rotated["version"], rotated["hosts"]) == (2, ["api.example.com"])
    admin("secret", "rotate", "nope", input=ROTATED, code=1)
    admin("secret", "delete", "bot")
    assert admin.json("secret", "list") == []

    # Audit: list and verify each entry's hash.
    actions = [entry["action"] for entry in admin.json("audit", "list")]
    assert {"policy.upload", "profiles.attach", "secret.set", "secret.delete"} <= set(actions)
    assert admin.json("audit", "verify")["ok"] is True
    # Export with the chain's hashes, then verify offline; an edited line or a broken one fails.
    exported = tmp_path / "audit.ndjson"
    admin("audit", "export", "--output", str(exported))
    lines = exported.read_text().splitlines()
    assert [json.loads(line)["action"] for line in lines] == actions
    assert all(len(json.loads(line)["hash"]) == 64 for line in lines)
    offline = admin.json("audit", "verify", "--file", str(exported))
    assert offline["ok"] is True and offline["entries"] == len(lines)
    assert offline["head"] == json.loads(lines[-1])["hash"]
    edited = json.loads(lines[0])
    edited["actor"] = "someone-else"
    tampered = tmp_path / "tampered.ndjson"
    tampered.write_text("\n".join([json.dumps(edited), *lines[1:]]) + "\n")
    assert (
        "does not match its hash"
        in admin("audit", "verify", "--file", str(tampered), code=1).output
    )
    tampered.write_text(lines[0] + "\n{not json\n")
    assert f"{tampered}:2: not JSON" in " ".join(
        admin("audit", "verify", "--file", str(tampered), code=2).output.split()
    )

    # Logs: filters, 80-column layout, --wide, --quarantined, --follow.
    long_path = "/" + "x" * 300
    records = [
        traffic_record(team.name, cvm_id=cvm, owner=team.dev_subject, path=long_path),
        traffic_record(
            team.name, cvm_id=cvm, decision="deny", reason="no_rule", rule_id=None, host="a.io"
        ),
    ]
    bad = traffic_record(team.name, decision="maybe")
    result = team.scvm.post("/api/v1/traffic/batches", json={"records": [*records, bad]})
    assert result.json()["quarantined"] == 1
    denied = admin.json("logs", "--decision", "deny", "--reason", "no_rule", "--until", "0s")
    assert [r["id"] for r in denied] == [records[1]["id"]]
    assert admin.json("logs", "--owner", team.dev_subject)[0]["id"] == records[0]["id"]
    from umbra.cli import output

    # The CLI's rich console is created once per process; pin an 80-column terminal for this call.
    monkeypatch.setattr(output.console, "_width", 80)
    narrow = admin("logs", "--cvm", cvm).output
    monkeypatch.undo()
    assert all(len(line) <= 80 for line in narrow.splitlines()), narrow
    assert cvm not in narrow and cvm[-6:] in narrow
    wide = admin("logs", "--cvm", cvm, "--wide").output
    assert cvm in wide and long_path in wide
    quarantined = admin.json("logs", "--quarantined")
    assert [q["reason"] for q in quarantined] == ["invalid"]
    assert "decision: enum" in quarantined[0]["detail"]

    import umbra.cli.logs as logs_module

    sleeps: list[float] = []

    def stop_after_one_poll(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 1:
            team.scvm.post("/api/v1/traffic/batches", json={"records": [late]})
        else:
            raise KeyboardInterrupt

    late = traffic_record(team.name, host="late.example")
    monkeypatch.setattr(logs_module.time, "sleep", stop_after_one_poll)
    followed = admin("logs", "--follow", "--json").stdout
    ids = [json.loads(chunk)["id"] for chunk in followed.replace("}\n{", "}\x00{").split("\x00")]
    assert ids[-1] == late["id"] and records[0]["id"] in ids

    everything = "\n".join(admin.outputs)
    assert SECRET not in everything and ROTATED not in everything and token not in everything


def test_team_default_profiles_and_conditional_rotation(
    server: Server, team: Team, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = Cli(tmp_path / "admin")
    token = str(team.admin.headers["Authorization"]).removeprefix("Bearer ")
    admin("auth", "login", server.url, "--token-file", "-", "--team", team.name, input=token)
    assert team.upload(1).status_code == 201

    # Team defaults: the same verbs with --team-default; new Dev CVMs get them at launch.
    assert admin.json("profile", "list", "--team-default")["profiles"] == []
    added = admin.json("profile", "attach", "--team-default", "github", "web")
    assert added == {"team": team.name, "team_default": True, "profiles": ["github", "web"]}
    assert admin.json("profile", "detach", "--team-default", "web")["profiles"] == ["github"]
    assert "422" in admin("profile", "attach", "--team-default", "nope", code=1).output
    cvm = team.dev_cvm()
    assert admin.json("profile", "list")["cvms"][cvm] == ["github"]
    assert "github" in admin("profile", "list", "--team-default").output
    assert "CVM id" in admin("profile", "attach", "github", code=2).output

    # A rotation racing another: the Console answers 412 and the CLI says nothing was stored.
    admin("secret", "set", "bot", "--host", "api.example.com", input=SECRET)
    from umbra.console.client import ConsoleClient

    read = ConsoleClient.list_secrets

    def read_then_someone_rotates(self: ConsoleClient, *args: Any, **kwargs: Any) -> Any:
        rows = read(self, *args, **kwargs)
        team.admin.put(f"/api/v1/teams/{team.name}/secrets/bot", json={"value": "other-admin"})
        return rows

    monkeypatch.setattr(ConsoleClient, "list_secrets", read_then_someone_rotates)
    lost = admin.json("secret", "rotate", "bot", input=ROTATED, code=1)
    assert "was NOT stored" in lost["error"] and "version 1" in lost["error"]
    monkeypatch.undo()
    assert admin.json("secret", "rotate", "bot", input=ROTATED)["version"] == 3
    assert ROTATED not in "\n".join(admin.outputs)


def test_help_lists_commands_without_importing_them() -> None:
    code = (
        "import sys; sys.argv = ['umbra', '--help']\n"
        "from umbra.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in sys.modules if m.startswith(('umbra.cli.', 'umbra.console', "
        "'umbra.proxy', 'fastapi', 'mitmproxy', 'pulumi', 'sqlalchemy', 'rich'))]\n"
        "print('IMPORTED', sorted(set(heavy) - {'umbra.cli.app'}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "IMPORTED []" in result.stdout, result.stdout
    for name in [*SUBCOMMANDS, *COMMANDS]:
        assert f" {name} " in result.stdout


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_static_help_matches_the_module(name: str) -> None:
    module, attribute, help_text = SUBCOMMANDS[name]
    sub_app = getattr(importlib.import_module(module), attribute)
    assert sub_app.info.help == help_text


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_static_help_of_top_level_commands_matches_the_module(name: str) -> None:
    module, attribute, help_text = COMMANDS[name]
    command = typer.main.get_command(getattr(importlib.import_module(module), attribute))
    assert (command.help or "").strip().splitlines()[0] == help_text
