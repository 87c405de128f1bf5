"""Denials an agent can act on, through the real proxy: the first line of a 403 says what was
refused, why, which profiles are attached and what a human would change, and never carries a
secret. Before, the body was `umbra: denied (<reason>)` alone (these tests fail on that code)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.agents.stack import Stack, start_stack

TEAM_KEY = "TEAMKEY-5d1e9a0b7c3f2e48a6d0"
MISSING_KEY_HOSTS = ["keyed.test"]
PLANTED = "AKIA" + "UMBRATESTPLANTED"

WEB = """
apiVersion: umbra/v1
kind: Profile
name: web
egress:
  - id: api
    allow: {hosts: [api.test], methods: [GET, POST], ports: [{port}]}
  - id: no-admin
    deny: {hosts: [api.test], ports: [{port}], paths: ["/admin/**"]}
inject:
  - {id: key, header: X-Api-Key, format: "{secret}", secret: team/api-key, hosts: [api.test], ports: [{port}]}
"""
EXTRA = """
apiVersion: umbra/v1
kind: Profile
name: extra
egress:
  - id: other
    allow: {hosts: [other.test], ports: [{port}]}
"""
KEYED = """
apiVersion: umbra/v1
kind: Profile
name: keyed
egress:
  - id: keyed-api
    allow: {hosts: [keyed.test], ports: [{port}], paths: ["/v1/**"]}
  - id: keyed-docs
    allow: {hosts: [docs.keyed.test], ports: [{port}]}
inject:
  - {id: token, header: Authorization, format: "Bearer {secret}", secret: team/keyed-token, hosts: [keyed.test], ports: [{port}]}
"""
PUBLIC = """
apiVersion: umbra/v1
kind: Profile
name: public
egress:
  - id: public-docs
    allow: {hosts: [keyed.test], methods: [GET], ports: [{port}], paths: ["/public/**"]}
"""
NAMES = ["api.test", "other.test", "evil.test", "keyed.test", "docs.keyed.test"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(
        tmp_path_factory.mktemp("denials"),
        NAMES,
        {"web": WEB, "extra": EXTRA, "keyed": KEYED, "public": PUBLIC},
        attached=["web", "keyed", "public"],
        secrets={"team": {"api-key": TEAM_KEY}},
    )
    yield running
    output = running.stop()
    assert TEAM_KEY not in output


def _curl(stack: Stack, method: str, url: str, *args: str) -> tuple[int, str, str]:
    done = subprocess.run(
        [
            "curl", "-sS", "--max-time", "20", "-D", "-", "--suppress-connect-headers", "-X", method,
            "--proxy", stack.proxy_url, "--cacert", str(stack.proxy.ca), *args, url,
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    head, _, body = done.stdout.partition("\n\n")  # text mode: CRLF is read as LF
    status = int(head.split(" ", 2)[1]) if head.startswith("HTTP/") else 0
    return status, head.lower(), body


def _url(stack: Stack, host: str, path: str) -> str:
    return f"https://{host}:{stack.origin.port}{path}"


def test_a_denied_host_names_the_request_the_profiles_and_the_change(stack: Stack) -> None:
    status, head, body = _curl(stack, "GET", _url(stack, "evil.test", "/x/y?token=abc"))
    assert status == 403 and "x-umbra-reason: no_matching_rule" in head
    first = body.splitlines()[0]
    assert first.startswith("umbra: denied (no_matching_rule): ")
    assert f"GET https://evil.test:{stack.origin.port}/x/y:" in first
    assert "attached profiles: keyed, public, web" in first
    assert "propose an allow rule for GET evil.test" in first
    assert "token=abc" not in body, "a query value is never repeated back"


def test_a_host_another_profile_allows_names_that_profile(stack: Stack) -> None:
    status, _, body = _curl(stack, "GET", _url(stack, "other.test", "/"))
    assert status == 403
    assert "ask an admin to attach profile extra" in body.splitlines()[0]


def test_a_denied_method_and_a_deny_rule(stack: Stack) -> None:
    status, head, body = _curl(stack, "DELETE", _url(stack, "api.test", "/items/1"))
    assert status == 403 and "no_matching_rule" in head
    assert "DELETE https://api.test" in body and "/items/1" in body
    status, head, body = _curl(stack, "GET", _url(stack, "api.test", "/admin/users"))
    first = body.splitlines()[0]
    assert status == 403 and "x-umbra-reason: rule_deny" in head
    assert "deny rule web:no-admin matches it" in first
    assert "propose a change to rule web:no-admin" in first
    assert "rule: web:no-admin" in body.splitlines()


def test_secret_exfiltration_is_explained_without_repeating_the_secret(stack: Stack) -> None:
    mark = stack.proxy.log.mark()
    status, head, body = _curl(
        stack, "POST", _url(stack, "api.test", f"/upload/{PLANTED}"), "--data", f"k={PLANTED}"
    )
    assert status == 403 and "x-umbra-reason: secret_detected" in head
    first = body.splitlines()[0]
    assert first.startswith("umbra: denied (secret_detected): POST https://api.test:")
    assert "looks like a credential" in first and "remove the credential" in first
    assert PLANTED not in body and "/upload" not in body
    assert TEAM_KEY not in body
    stack.proxy.log.wait_for(mark, lambda r: r["reason"] == "secret_detected")
    # A path naming the proxy's own secret is redacted from the answer too.
    status, _, body = _curl(stack, "GET", _url(stack, "evil.test", f"/{TEAM_KEY}"))
    assert status == 403 and TEAM_KEY not in body


def test_clients_that_ask_for_json_get_the_sentence_as_error(stack: Stack) -> None:
    status, head, body = _curl(
        stack, "GET", _url(stack, "evil.test", "/pkg"), "-H", "accept: application/json"
    )
    assert status == 403 and "content-type: application/json" in head
    document = json.loads(body)
    assert document["error"].startswith("umbra: denied (no_matching_rule): GET https://evil.test")
    assert document["umbra"]["reason"] == "no_matching_rule"
    assert document["umbra"]["profiles"] == ["keyed", "public", "web"]


def test_a_missing_secret_denies_only_what_would_carry_it_and_names_it(stack: Stack) -> None:
    mark = stack.proxy.log.mark()
    status, head, body = _curl(stack, "GET", _url(stack, "keyed.test", "/v1/things"))
    assert status == 403 and "x-umbra-reason: secret_unavailable" in head
    first = body.splitlines()[0]
    assert "needs secret team/keyed-token, which is not set" in first
    assert "umbra secret set keyed-token --host keyed.test" in first
    assert "missing secret: team/keyed-token" in body.splitlines()
    record = stack.proxy.log.wait_for(mark, lambda r: r["reason"] == "secret_unavailable")
    assert record["rule_id"] == "keyed:token" and "team/keyed-token" in record["detail"]
    # The same profile's other host carries no credential: it is not denied.
    status, _, _ = _curl(stack, "GET", _url(stack, "docs.keyed.test", "/"))
    assert status == 200
    # Nor is a request to the same host that another profile allows: it would not carry the
    # credential (the old code injected per host, so it was denied too).
    status, _, _ = _curl(stack, "GET", _url(stack, "keyed.test", "/public/readme"))
    assert status == 200
    seen = [s for s in stack.recorder.snapshot() if s.path == "/public/readme"][-1]
    assert seen.header("authorization") == []
    # And the other profile's injected host still works (its secret is set).
    status, _, _ = _curl(stack, "GET", _url(stack, "api.test", "/v1/ok"))
    assert status == 200
    seen = [s for s in stack.recorder.snapshot() if s.path == "/v1/ok"][-1]
    assert seen.header("x-api-key") == [TEAM_KEY]


def test_a_placeholder_is_replaced_only_where_its_injection_applies(stack: Stack) -> None:
    # keyed.test/public/* is allowed by `public`, which injects nothing: the placeholder for
    # keyed's secret would go out as it is, so it is refused.
    status, head, body = _curl(
        stack, "GET", _url(stack, "keyed.test", "/public/x"),
        "-H", "authorization: Bearer umbra-placeholder:team/keyed-token",
    )  # fmt: skip
    assert status == 403 and "x-umbra-reason: placeholder_unbound" in head
    assert "team/keyed-token" not in body
    # On api.test the placeholder of the secret `web` injects is replaced, as before.
    status, _, _ = _curl(
        stack, "GET", _url(stack, "api.test", "/v1/ph"),
        "-H", "x-api-key: umbra-placeholder:team/api-key",
    )  # fmt: skip
    assert status == 200
    seen = [s for s in stack.recorder.snapshot() if s.path == "/v1/ph"][-1]
    assert seen.header("x-api-key") == [TEAM_KEY]
