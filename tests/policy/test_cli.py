"""`umbra policy` end to end through the typer app, including diff across real git revisions."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from umbra.cli.app import app

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED = REPO_ROOT / "policies"
runner = CliRunner()


def umbra(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_the_shipped_policies_check_and_test_clean() -> None:
    code, out, _ = umbra("policy", "check", str(SHIPPED), "--json")
    assert code == 0
    report = json.loads(out)
    assert {"github", "pypi", "npm", "debian", "anthropic", "openai"} <= set(report["profiles"])
    code, out, _ = umbra("policy", "test", str(SHIPPED), "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["failed"] == 0 and report["passed"] >= 40


def test_check_reports_file_line_and_field(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "apiVersion: umbra/v1\nkind: Profile\nname: p\negress:\n  - allow: {hosts: [x.com], methods: [YOINK]}\n"
    )
    code, out, err = umbra("policy", "check", str(tmp_path))
    assert code == 1
    assert f"{tmp_path / 'p.yaml'}:5: egress[0].allow.methods[0]:" in " ".join(err.split())
    assert "Traceback" not in out + err
    code, out, _ = umbra("policy", "check", str(tmp_path), "--json")
    [issue] = json.loads(out)["issues"]
    assert (issue["line"], issue["field"]) == (5, "egress[0].allow.methods[0]")


def policy_copy(tmp_path: Path) -> Path:
    target = tmp_path / "policies"
    shutil.copytree(SHIPPED, target)
    return target


def test_a_failing_case_fails_the_run_with_its_location(tmp_path: Path) -> None:
    policies = policy_copy(tmp_path)
    suite = policies / "tests" / "pypi.yaml"
    suite.write_text(
        suite.read_text().replace(
            "POST https://upload.pypi.org/legacy/\n    expect: deny",
            "POST https://upload.pypi.org/legacy/\n    expect: allow",
        )
    )
    code, out, _ = umbra("policy", "test", str(policies))
    assert code == 1
    assert "pypi.yaml" in out and "expected allow, got deny" in " ".join(out.split())
    assert "1 failed" in out


def test_policy_test_shows_which_placements_a_request_gets(tmp_path: Path) -> None:
    policies = policy_copy(tmp_path)
    suite = policies / "tests" / "gemini.yaml"
    suite.write_text(suite.read_text().replace('inject: ["?key"]', "inject: [X-Goog-Api-Key]", 1))
    code, out, _ = umbra("policy", "test", str(policies))
    assert code == 1
    assert "expected injected placements ['X-Goog-Api-Key'], got ['?key']" in " ".join(out.split())
    code, out, _ = umbra(
        "policy",
        "decide",
        "GET https://acme.atlassian.net/rest/api/3/myself",
        str(SHIPPED),
        "-p",
        "atlassian",
        "--json",
    )
    assert code == 0 and json.loads(out)["inject"] == ["Authorization"]


def test_check_refuses_a_bad_placement_with_file_line_and_field(tmp_path: Path) -> None:
    policies = policy_copy(tmp_path)
    profile = policies / "profiles" / "gemini.yaml"
    profile.write_text(profile.read_text().replace("query: key", "query: 'key&x'"))
    code, out, _ = umbra("policy", "check", str(policies), "--json")
    assert code == 1
    [issue] = json.loads(out)["issues"]
    assert (Path(issue["file"]).name, issue["line"], issue["field"]) == (
        "gemini.yaml",
        17,
        "inject[0].query",
    )


def test_build_then_verify(tmp_path: Path) -> None:
    key = tmp_path / "release.pem"
    assert umbra("policy", "keygen", str(key))[0] == 0
    assert key.stat().st_mode & 0o077 == 0, "the private key is readable by its owner only"
    bundle = tmp_path / "bundle.json"
    code, out, _ = umbra(
        "policy",
        "build",
        str(SHIPPED),
        "--sign-key",
        str(key),
        "--serial",
        "42",
        "-o",
        str(bundle),
        "--json",
    )
    assert code == 0, out
    built = json.loads(out)
    code, out, _ = umbra("policy", "verify", str(bundle), "--key", f"{key}.pub", "--json")
    assert code == 0
    verified = json.loads(out)
    assert verified["hash"] == built["hash"] and verified["serial"] == 42
    other = tmp_path / "other.pem"
    umbra("policy", "keygen", str(other))
    code, _, err = umbra("policy", "verify", str(bundle), "--key", f"{other}.pub")
    assert code == 1 and "not signed by any pinned key" in err
    assert umbra("policy", "keygen", str(key))[0] == 2, "keygen never overwrites a key"


def test_build_refuses_without_key_or_with_failing_tests(tmp_path: Path) -> None:
    assert umbra("policy", "build", str(SHIPPED), "--serial", "1")[0] == 2
    policies = policy_copy(tmp_path)
    (policies / "tests" / "extra.yaml").write_text(
        "apiVersion: umbra/v1\nkind: PolicyTest\nname: extra\nprofiles: [pypi]\ncases:\n  - {request: GET https://example.com/, expect: allow}\n"
    )
    key = tmp_path / "k.pem"
    umbra("policy", "keygen", str(key))
    bundle = tmp_path / "bundle.json"
    code, _, err = umbra(
        "policy", "build", str(policies), "--sign-key", str(key), "--serial", "1", "-o", str(bundle)
    )
    assert code == 1 and "policy test(s) fail" in err
    assert not bundle.exists(), "nothing is written when a test fails"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


@pytest.fixture
def policy_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    shutil.copytree(SHIPPED, repo / "policies")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "base")
    pypi = repo / "policies" / "profiles" / "pypi.yaml"
    text = pypi.read_text()
    text = text.replace(
        "  - id: no-upload\n    comment: publishing is an exfiltration channel\n    deny: {hosts: [upload.pypi.org, test.pypi.org]}\n",
        "",
    )
    text += '  - id: upload\n    allow: {hosts: [upload.pypi.org], methods: [POST], paths: ["/legacy/"]}\n'
    pypi.write_text(text)
    suite = repo / "policies" / "tests" / "pypi.yaml"
    suite.write_text(
        suite.read_text().replace(
            "    expect: deny\n    rule: pypi:no-upload\n", "    expect: allow\n"
        )
    )
    git(repo, "commit", "-qam", "allow uploads")
    return repo


def test_diff_shows_widening_grants_and_changed_decisions(policy_repo: Path) -> None:
    code, out, _ = umbra("policy", "diff", "HEAD~1", "HEAD", "--repo", str(policy_repo), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["widens"] is True
    added = {tuple(change["grant"]) for change in report["added"]}
    assert ("allow", "upload.pypi.org", "https:443", "POST", "/legacy/") in added
    removed = {tuple(change["grant"]) for change in report["removed"]}
    assert ("deny", "upload.pypi.org", "https:443", "*", "/**") in removed
    [change] = [d for d in report["decisions"] if "upload.pypi.org" in d["request"]]
    assert change["before"].startswith("deny") and change["after"].startswith("allow")
    assert (
        umbra("policy", "diff", "HEAD~1", "HEAD", "--repo", str(policy_repo), "--fail-on-widen")[0]
        == 1
    )


def test_diff_in_the_narrowing_direction_does_not_widen(policy_repo: Path) -> None:
    code, out, _ = umbra(
        "policy", "diff", "HEAD", "HEAD~1", "--repo", str(policy_repo), "--fail-on-widen"
    )
    assert code == 0
    assert "does not widen" in out
    code, out, _ = umbra("policy", "diff", "HEAD", "HEAD", "--repo", str(policy_repo))
    assert code == 0 and "No effective change" in out


def test_diff_of_an_unknown_revision_is_a_clean_error(policy_repo: Path) -> None:
    code, out, err = umbra("policy", "diff", "nope", "HEAD", "--repo", str(policy_repo))
    assert code == 1 and "git ls-tree failed" in err and "Traceback" not in out + err


def test_schema_is_json_schema_for_profiles() -> None:
    code, out, _ = umbra("policy", "schema")
    assert code == 0
    document = json.loads(out)
    assert document["$schema"].endswith("2020-12/schema")
    assert {"apiVersion", "kind", "name", "egress"} <= set(document["properties"])
    assert document["additionalProperties"] is False


def test_decide_allows_an_npm_scoped_package() -> None:
    """The issue's own command: it denied with invalid_path before encoded slashes were read."""
    code, out, _ = umbra(
        "policy",
        "decide",
        "GET https://registry.npmjs.org/@anthropic-ai%2fclaude-code",
        str(SHIPPED),
        "-p",
        "npm",
        "--json",
    )
    assert code == 0
    result = json.loads(out)
    assert (result["verdict"], result["rule"]) == ("allow", "npm:registry-read")


def test_decide_explains_one_request() -> None:
    code, out, _ = umbra(
        "policy",
        "decide",
        "POST https://api.github.com/repos/acme/w/hooks/1",
        str(SHIPPED),
        # github and github-app are alternatives (both inject Authorization for GitHub): a CVM
        # attaches one, and deciding with both attached is refused as a conflict.
        "-p",
        "github",
        "--json",
    )
    assert code == 0
    result = json.loads(out)
    assert (result["verdict"], result["rule"], result["inject"]) == (
        "deny",
        "github:no-repo-admin",
        [],
    )
    code, out, _ = umbra(
        "policy",
        "decide",
        "GET https://api.github.com/repos/acme/w",
        str(SHIPPED),
        "-p",
        "github",
        "--json",
    )
    assert json.loads(out)["inject"] == ["Authorization"]


def test_decide_checks_a_git_push_by_ref(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "apiVersion: umbra/v1\nkind: Profile\nname: p\negress:\n  - id: push\n"
        "    allow: {hosts: [git.x.com], methods: [POST]}\n    push_refs: ['refs/heads/agent/**']\n"
    )
    url = "POST https://git.x.com/r.git/git-receive-pack"
    for ref, verdict, reason in (
        ("refs/heads/agent/a", "allow", "rule_allow"),
        ("refs/heads/main", "deny", "push_ref_denied"),
    ):
        code, out, _ = umbra("policy", "decide", url, str(tmp_path), "--push", ref, "--json")
        assert code == 0
        assert (json.loads(out)["verdict"], json.loads(out)["reason"]) == (verdict, reason)


def test_decide_checks_field_and_mcp_rules_on_a_body(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "apiVersion: umbra/v1\nkind: Profile\nname: p\negress:\n"
        "  - id: slack\n    allow: {hosts: [slack.com], methods: [POST]}\n"
        "    body: [{pointer: /channel, one_of: [C1]}]\n"
        "  - id: tools\n    allow: {hosts: [mcp.x.com], paths: [/mcp]}\n"
        "    mcp: {tools: [{name: echo}]}\n"
    )
    slack = "POST https://slack.com/api/chat.postMessage"
    mcp = "POST https://mcp.x.com/mcp"

    def call(name: str) -> str:
        message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name}}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(message))
        return str(path)

    (tmp_path / "c1.json").write_text('{"channel": "C1"}')
    (tmp_path / "form").write_text("channel=C3")
    for url, extra, verdict, reason in (
        (slack, ["--body", str(tmp_path / "c1.json")], "allow", "rule_allow"),
        (slack, ["--body", str(tmp_path / "form"), "--content-type",
                 "application/x-www-form-urlencoded"], "deny", "body_field_denied"),
        (slack, [], "deny", "body_field_denied"),  # no body: decided on an empty one
        (mcp, ["--body", call("echo")], "allow", "rule_allow"),
        (mcp, ["--body", call("delete_repo")], "deny", "mcp_tool_denied"),
    ):  # fmt: skip
        code, out, _ = umbra("policy", "decide", url, str(tmp_path), *extra, "--json")
        assert code == 0, out
        assert (json.loads(out)["verdict"], json.loads(out)["reason"]) == (verdict, reason), extra
    # stdin, and a missing file is a usage error naming it
    result = runner.invoke(
        app, ["policy", "decide", mcp, str(tmp_path), "--body", "-", "--json"],
        input='{"jsonrpc": "2.0", "id": 1, "method": "resources/read"}',
    )  # fmt: skip
    assert json.loads(result.stdout)["reason"] == "mcp_method_denied"
    code, out, _ = umbra("policy", "decide", mcp, str(tmp_path), "--body", "/nope", "--json")
    assert code == 2 and "--body /nope" in json.loads(out)["error"]
