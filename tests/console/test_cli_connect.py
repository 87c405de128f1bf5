"""`umbra connect|disconnect claude|codex` (also spelt `umbra claude|codex connect|disconnect`) against a running Console (real OIDC issuer, SQLite
and PostgreSQL): the login stored as the developer's personal secret of the right kind, the
agent's profile attached to their own Dev CVM by them (not an admin), both removed again; the
token bytes appear in no output, no file the CLI wrote and no database byte."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from tests.console.helpers import CaptureHandler, Server, Team, make_bundle, profile
from tests.console.test_cli_client import Cli, files_under, token_of
from tests.console.test_secrets import database_bytes, encodings
from umbra.policy.loader import load_policy_dir

REPO = Path(__file__).resolve().parents[2]
CLAUDE = "sk-ant-oat01-" + "Cl4udeSubscr1ption" * 4
REFRESH = "rt-connect-" + "R0tat1ng" * 5
ACCESS_SECRET = "acc3ss" * 6


def _jwt(claims: dict[str, object]) -> str:
    def part(doc: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")

    return f"{part({'alg': 'none'})}.{part(claims)}.{ACCESS_SECRET}"


def _bundle(server: Server) -> bytes:
    shipped = load_policy_dir(REPO / "policies").profiles
    templates = [shipped[n].compiled for n in ("claude-subscription", "codex-chatgpt")]
    return make_bundle(server.bundle_key, 7, [*templates, profile("github", hosts=["github.com"])])


def test_connect_and_disconnect_the_agents(
    server: Server,
    team: Team,
    tmp_path: Path,
    log_capture: CaptureHandler,
    request: pytest.FixtureRequest,
) -> None:
    assert team.upload(7, _bundle(server)).status_code in (200, 201)
    mine = team.dev_cvm()
    team.admin.put(
        f"/api/v1/cvms/{mine}/profiles", json={"profiles": ["github"]}
    ).raise_for_status()
    theirs = team.dev_cvm(owner=team.admin)
    dev = Cli(tmp_path / "dev")
    dev("auth", "login", team.server.url, "--token-file", "-", input=token_of(team.dev))

    # claude: the setup-token output on stdin (its banner around the token is ignored).
    banner = f"Your OAuth token (valid for 1 year):\n\n{CLAUDE}\n\nStore it.\n"
    made = json.loads(dev("connect", "claude", "--token-file", "-", "--json", input=banner).stdout)
    assert made == {"agent": "claude", "secret": "personal/claude-oauth-token", "kind": "static",
                    "profile": "claude-subscription", "cvms": [mine]}  # fmt: skip
    cvm = team.dev.get(f"/api/v1/cvms/{mine}").json()
    assert cvm["profiles"] == ["claude-subscription", "github"]
    assert team.admin.get(f"/api/v1/cvms/{theirs}").json()["profiles"] == []

    # codex: its auth.json; the client id comes from the id token's `aud`, expiry from `exp`.
    auth = tmp_path / "auth.json"
    access = _jwt({"exp": 2_000_000_000})
    auth.write_text(json.dumps({"OPENAI_API_KEY": None, "tokens": {
        "id_token": _jwt({"aud": ["app_codex_test"]}), "access_token": access,
        "refresh_token": REFRESH, "account_id": "acct"}}))  # fmt: skip
    # The spelling, `umbra codex connect`, is the same command.
    codex = dev.json("codex", "connect", "--auth-file", str(auth))
    assert (codex["secret"], codex["kind"]) == ("personal/codex-chatgpt", "oauth2-refresh")
    listed = {s["ref"]: s for s in dev.json("secret", "list")}
    assert listed["personal/codex-chatgpt"]["hosts"] == ["chatgpt.com"]
    assert listed["personal/claude-oauth-token"]["hosts"] == ["api.anthropic.com"]
    profiles = team.dev.get(f"/api/v1/cvms/{mine}").json()["profiles"]
    assert profiles == ["claude-subscription", "codex-chatgpt", "github"]

    # The owner may attach nothing else; a file without a login is refused before any call.
    other = team.dev.put(f"/api/v1/cvms/{mine}/profiles",
                         json={"profiles": [*profiles, "github-extra"]})  # fmt: skip
    assert other.status_code == 403
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    refused = dev("connect", "codex", "--auth-file", str(empty), code=2)
    assert "codex login" in refused.output
    dev("connect", "claude", "--token-file", "-", input="two words\n", code=2)

    gone = dev.json("disconnect", "claude")
    assert gone == {"agent": "claude", "deleted": True, "profile": "claude-subscription",
                    "cvms": [mine]}  # fmt: skip
    assert dev.json("codex", "disconnect")["deleted"] is True
    assert team.dev.get(f"/api/v1/cvms/{mine}").json()["profiles"] == ["github"]
    assert dev.json("secret", "list") == []
    assert dev.json("disconnect", "claude")["deleted"] is False  # idempotent

    secrets = (CLAUDE, REFRESH, ACCESS_SECRET)
    everything = "\n".join(dev.outputs) + log_capture.text()
    for value in secrets:
        assert value not in everything
    for path in files_under(tmp_path / "dev"):
        for value in secrets:
            assert value.encode() not in path.read_bytes(), path
    blobs = list(database_bytes(server, request))
    for value in (CLAUDE, REFRESH):
        for encoded in encodings(value):
            assert all(encoded not in blob for blob in blobs), "a token is in the database"
