from __future__ import annotations

from tests.proxy.conftest import Env
from tests.proxy.harness import TEAM_SECRET, curl, curl_status


def test_allowed_request_gets_injected_credential(env: Env) -> None:
    mark = env.proxy.log.mark()
    result = curl(env.proxy, f"https://api.test:{env.origin.port}/hello?x=1&token=abc")
    assert curl_status(result) == 200, result
    seen = [s for s in env.recorder.snapshot() if s.path.startswith("/hello")][-1]
    assert seen.header("authorization") == [f"Bearer {TEAM_SECRET}"]
    assert not seen.header("proxy-authorization")
    record = env.proxy.log.wait_for(mark, lambda r: r["decision"] == "allow")
    assert record["cvm_id"] == "cvm-alice" and record["owner"] == "alice"
    assert record["query_keys"] == ["token", "x"]
    assert record["injected_headers"] == ["Authorization"]
    assert record["pinned_ip"] == "127.0.0.1"
    assert record["rule_id"] == "testing:api"
    assert record["status"] == 200


def test_unlisted_host_is_denied(env: Env) -> None:
    mark = env.proxy.log.mark()
    result = curl(env.proxy, f"https://evil.test:{env.origin.port}/x")
    assert curl_status(result) == 403
    assert not any(s.host.startswith("evil.test") for s in env.recorder.snapshot())
    record = env.proxy.log.wait_for(mark, lambda r: r["decision"] == "deny")
    assert record["reason"] == "no_matching_rule"
