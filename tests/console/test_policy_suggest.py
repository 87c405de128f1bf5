"""`umbra policy suggest`: a CVM's denials from a running Console drafted into a profile and a
suite that `umbra policy check` and `umbra policy test` accept; narrowest first; denials that
allowing cannot fix are not drafted."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml

from tests.console.helpers import Server, Team, traffic_record
from tests.console.test_cli_client import Cli, token_of
from umbra.policy.suggest import Denial, _prefix, draft


def denied(
    team: Team, cvm: str, host: str, path: str, method: str = "GET", **extra: object
) -> dict[str, object]:
    fields: dict[str, object] = {
        "cvm_id": cvm, "owner": team.dev_subject, "decision": "deny", "reason": "no_matching_rule",
        "method": method, "host": host, "connect_host": host, "sni": host, "port": 443, "path": path,
        "status": 403, "rule_id": None, "time": (datetime.now(UTC) - timedelta(minutes=5)).isoformat(),
    }  # fmt: skip
    fields.update(extra)
    return traffic_record(team.name, **fields)


def test_suggest_drafts_a_profile_that_passes_policy_test(
    server: Server, team: Team, tmp_path: Path
) -> None:
    cvm = team.dev_cvm()
    records = [
        denied(team, cvm, "api.example.com", "/v2/repos/acme/a"),
        denied(team, cvm, "api.example.com", "/v2/repos/acme/b/issues"),
        denied(team, cvm, "api.example.com", "/v2/repos/acme/a", method="POST"),
        denied(team, cvm, "files.example.net", "/"),
        denied(team, cvm, "evil.example", "/x", reason="rule_deny", rule_id="base:no-evil"),
        denied(team, cvm, "api.example.com", "/k", reason="secret_detected"),
    ]
    assert team.scvm.post("/api/v1/traffic/batches", json={"records": records}).status_code == 200
    dev = Cli(tmp_path / "dev")
    dev("auth", "login", server.url, "--token-file", "-", input=token_of(team.dev))
    out = tmp_path / "draft"
    report = dev.json(
        "policy", "suggest", "--cvm", cvm, "--since", "1h", "--name", "agent-x", "--out", str(out)
    )
    assert report["rules"] == 3 and report["skipped"] == {"rule_deny": 1, "secret_detected": 1}
    profile = yaml.safe_load((out / "profiles" / "agent-x.yaml").read_text())
    rules = {rule["id"]: rule["allow"] for rule in profile["egress"]}
    assert rules["api-example-com-get"] == {
        "hosts": ["api.example.com"], "methods": ["GET"], "paths": ["/v2/repos/acme/**"],
    }  # fmt: skip
    assert rules["api-example-com-post"]["paths"] == ["/v2/repos/acme/a"]  # one path: exact
    assert rules["files-example-net-get"]["paths"] == ["/"]
    text = (out / "profiles" / "agent-x.yaml").read_text()
    assert text.startswith("# DRAFT") and "not drafted: 1 denial(s) for rule_deny" in text
    assert "evil.example" not in text
    # the draft passes the policy tools as written
    checker = Cli(tmp_path / "any")
    checker("policy", "check", str(out))
    tested = checker.json("policy", "test", str(out))
    assert tested["failed"] == 0 and tested["passed"] == 4
    # never overwrites a file
    dev("policy", "suggest", "--cvm", cvm, "--name", "agent-x", "--out", str(out), code=2)


def test_prefix_and_a_whole_host_draft_say_so() -> None:
    assert _prefix(["/a/b/c", "/a/b/d"]) == "/a/b/**"
    assert _prefix(["/a", "/b"]) == "/**"
    assert _prefix(["/a/b"]) == "/a/b"
    result = draft(
        "p",
        [Denial("GET", "https", "x.test", 8443, "/a", "no_matching_rule"),
         Denial("GET", "https", "x.test", 8443, "/b", "no_policy")],
        "a test",
    )  # fmt: skip
    document = yaml.safe_load(result.profile)
    assert document["egress"][0]["allow"]["ports"] == [8443]
    assert "grants the whole host" in document["egress"][0]["comment"]
