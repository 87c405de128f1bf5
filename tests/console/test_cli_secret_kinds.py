"""`umbra secret set --kind K --file F|-`: a kind's document checked locally (field names, never
values), sent, listed with its kind and status; nothing of the document is ever printed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.console.helpers import Server, Team
from tests.console.test_cli_client import Cli, files_under, token_of

REFRESH = "rt-cli-5f0e9d8c7b6a5f4e3d2c"
AWS_SECRET = "aws-cli-secret-1a2b3c4d5e6f7a8b9c0d"


def test_secret_kinds_from_the_cli(server: Server, team: Team, tmp_path: Path) -> None:
    dev = Cli(tmp_path / "dev")
    dev("auth", "login", server.url, "--token-file", "-", input=token_of(team.dev))
    document = tmp_path / "codex.json"
    document.write_text(
        json.dumps(
            {
                "token_url": "https://auth.openai.com/oauth/token",
                "client_id": "app_codex",
                "refresh_token": REFRESH,
            }
        )
    )
    made = dev.json("secret", "set", "codex", "--personal", "--host", "chatgpt.com",
                    "--kind", "oauth2-refresh", "--file", str(document))  # fmt: skip
    assert (made["ref"], made["kind"], made["status"]) == ("personal/codex", "oauth2-refresh", "ok")
    aws = json.dumps({"access_key_id": "AKIAREALKEY000000001", "secret_access_key": AWS_SECRET})
    piped = dev("secret", "set", "aws", "--personal", "--host", "s3.amazonaws.com",
                "--kind", "aws-sigv4", "--file", "-", input=aws)  # fmt: skip
    assert "personal/aws (aws-sigv4, version 1)" in piped.output

    # Refused before anything is sent, naming the field and never the value.
    bad = json.dumps({"token_url": "http://plain.example/t", "client_id": "c",
                      "refresh_token": REFRESH})  # fmt: skip
    refused = dev("secret", "set", "codex", "--personal", "--host", "chatgpt.com",
                  "--kind", "oauth2-refresh", "--file", "-", input=bad, code=2)  # fmt: skip
    assert "token_url" in refused.output and REFRESH not in refused.output
    dev("secret", "set", "x", "--personal", "--host", "a.example", "--kind", "nope",
        "--file", "-", input="{}", code=2)  # fmt: skip
    needs_file = dev("secret", "set", "x", "--personal", "--host", "a.example",
                     "--kind", "aws-sigv4", input=aws, code=2)  # fmt: skip
    assert "--file" in needs_file.output
    missing = dev("secret", "set", "x", "--personal", "--host", "a.example",
                  "--kind", "aws-sigv4", "--file", str(tmp_path / "absent.json"), code=2)  # fmt: skip
    assert "cannot read" in missing.output

    listed = {item["ref"]: item for item in dev.json("secret", "list")}
    assert listed["personal/codex"]["kind"] == "oauth2-refresh"
    assert listed["personal/aws"]["kind"] == "aws-sigv4"
    table = dev("secret", "list").output
    assert "oauth2-refresh" in table and "aws-sigv4" in table

    everything = "\n".join(dev.outputs)
    assert REFRESH not in everything and AWS_SECRET not in everything
    for path in files_under(tmp_path / "dev"):
        assert REFRESH.encode() not in path.read_bytes(), path
