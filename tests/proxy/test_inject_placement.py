"""Placement beyond one header, through the real proxy: a query parameter, HTTP Basic (user given
or itself a secret), several headers per request, and injections bound to paths. An origin records
what it received; the secret's bytes (raw and every placed form) reach no record, log or response
to the sandbox, an origin echoing a placed form is cut, and a sandbox sending one is refused."""

from __future__ import annotations

import base64
import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.proxy.harness import (
    OriginHandler,
    OriginServer,
    ProxyProcess,
    Recorder,
    Seen,
    TestCA,
    curl,
    curl_status,
    start_proxy,
    write_identities,
)

# Characters a query must encode (`/ + = & space`), so the placed form differs from the raw one.
QUERY_SECRET = "QUERY/SECRET+7f3a=9c2e&51d8 b06a"
BASIC_PASS = "BASICPASS-2c9e7a41f05d8b3e6a17"
BASIC_USER = "svc-robot-71c3"
MULTI_A = "MULTI-A-SECRET-8d2f61b0c4e9a7"
MULTI_B = "MULTI-B-SECRET-3a7e90c1d52f48"
PATH_SECRET = "PATHSECRET-5e1b7c9d3f2a8e06b4"
HOSTS = ["q.test", "basic.test", "pair.test", "multi.test", "paths.test", "echo.test", "qdial.test"]


def forms() -> dict[str, bytes]:
    """Every secret as it could leak: raw, as placed on the wire (URL-encoded, Basic)."""
    placed = {
        "query-encoded": quote(QUERY_SECRET, safe=""),
        "basic": base64.b64encode(f"bot:{BASIC_PASS}".encode()).decode(),
        "basic-pair": base64.b64encode(f"{BASIC_USER}:{BASIC_PASS}".encode()).decode(),
    }
    raw = {
        "query": QUERY_SECRET,
        "pass": BASIC_PASS,
        "a": MULTI_A,
        "b": MULTI_B,
        "path": PATH_SECRET,
    }
    return {name: value.encode() for name, value in {**raw, **placed}.items()}


def policy(port: int) -> str:
    target = f"hosts: [%s], ports: [{port}]"
    return f"""
apiVersion: umbra/v1
kind: Profile
name: testing
egress:
  - id: api
    allow: {{{target % ", ".join(HOSTS)}}}
inject:
  - {{id: query-key, query: api_key, secret: team/query-key, {target % "q.test"}}}
  - {{id: basic-user, basic: {{user: bot}}, secret: team/basic-pass, {target % "basic.test"}}}
  - {{id: basic-pair, basic: {{user_secret: team/basic-user}}, secret: team/basic-pass, {target % "pair.test"}}}
  - id: multi-a
    headers:
      - {{header: X-Api-Key, format: "{{secret}}"}}
      - {{header: X-Api-Sig, format: "key={{secret}}"}}
    secret: team/multi-a
    hosts: [multi.test]
    ports: [{port}]
  - {{id: multi-b, header: X-Other-Key, format: "{{secret}}", secret: team/multi-b, {target % "multi.test"}}}
  - {{id: v1-only, header: Authorization, format: "Bearer {{secret}}", secret: team/path-key, paths: ["/v1/**"], {target % "paths.test"}}}
  - {{id: dial-query, query: api_key, secret: team/query-key, {target % "qdial.test"}}}
  - {{id: echo-query, query: key, secret: team/query-key, {target % "echo.test"}}}
  - {{id: echo-basic, basic: {{user: bot}}, secret: team/basic-pass, {target % "echo.test"}}}
"""


@dataclass
class PlacementEnv:
    workdir: Path
    recorder: Recorder
    origin: OriginServer
    proxy: ProxyProcess


def _echo(handler: OriginHandler, seen: Seen) -> None:
    """An origin that echoes what it received: the request target, or the Authorization header."""
    if seen.path.startswith("/echo-auth"):
        handler.send(200, f"you sent: {' '.join(seen.header('authorization'))}".encode())
    elif seen.path.startswith("/echo-header"):
        handler.send(200, b"nothing", {"x-echo": seen.path})
    else:
        handler.send(200, f"you asked for: {seen.path}".encode())


@pytest.fixture(scope="module")
def penv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlacementEnv]:
    workdir = tmp_path_factory.mktemp("placement")
    ca = TestCA(workdir)
    cert, key = ca.issue(HOSTS)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    recorder = Recorder()
    origin = OriginServer(recorder, tls).start()
    origin.routes["echo.test"] = _echo
    policy_dir = workdir / "policies"
    policy_dir.mkdir()
    (policy_dir / "testing.yaml").write_text(policy(origin.port))
    resolver = workdir / "resolver.json"
    # qdial.test resolves to a private address: the dial is refused after the injection.
    answers = {name: ["127.0.0.1"] for name in HOSTS} | {"qdial.test": ["10.0.0.9"]}
    resolver.write_text(json.dumps(answers))
    identities = workdir / "identities.json"
    write_identities(identities)
    secrets = workdir / "secrets.json"
    team = {
        "query-key": QUERY_SECRET,
        "basic-pass": BASIC_PASS,
        "basic-user": BASIC_USER,
        "multi-a": MULTI_A,
        "multi-b": MULTI_B,
        "path-key": PATH_SECRET,
    }
    secrets.write_text(json.dumps({"team": team}))
    secrets.chmod(0o600)
    proxy = start_proxy(
        [
            *("--policy-dir", str(policy_dir), "--identities", str(identities)),
            *("--secrets", str(secrets), "--upstream-ca", str(ca.cert_path)),
            *("--test-allow-upstream", "127.0.0.1/32", "--test-resolver", str(resolver)),
        ],
        workdir,
    )
    yield PlacementEnv(workdir, recorder, origin, proxy)
    output = proxy.stop().encode()
    origin.shutdown()
    # Neither the proxy's output nor its traffic log carries any form of any secret.
    spool = b"".join(p.read_bytes() for p in (workdir / "spool").glob("*.jsonl"))
    for name, form in forms().items():
        assert form not in output, f"{name} appeared in the proxy's output"
        assert form not in spool, f"{name} appeared in the traffic log"


def url(penv: PlacementEnv, host: str, target: str) -> str:
    return f"https://{host}:{penv.origin.port}{target}"


def last(penv: PlacementEnv, prefix: str) -> Seen:
    return [seen for seen in penv.recorder.snapshot() if seen.path.startswith(prefix)][-1]


def assert_no_secret_in(text: str) -> None:
    for name, form in forms().items():
        assert form.decode() not in text, f"{name} reached the sandbox"


def test_query_placement_replaces_the_placeholder_and_keeps_other_parameters(
    penv: PlacementEnv,
) -> None:
    mark = penv.proxy.log.mark()
    result = curl(
        penv.proxy,
        url(penv, "q.test", "/search?q=1&api_key=umbra-placeholder:team/query-key&api%5Fkey=x&z"),
    )
    assert curl_status(result) == 200
    assert_no_secret_in(result.stdout)
    seen = last(penv, "/search")
    assert seen.path == f"/search?q=1&z&api_key={quote(QUERY_SECRET, safe='')}"
    record = penv.proxy.log.wait_for(mark, lambda r: r.get("path") == "/search")
    assert record["decision"] == "allow" and sorted(record["query_keys"]) == ["api_key", "q", "z"]
    assert record["injected_headers"] == []


def test_query_placement_when_the_sandbox_sends_no_parameter(penv: PlacementEnv) -> None:
    assert curl_status(curl(penv.proxy, url(penv, "q.test", "/bare"))) == 200
    assert last(penv, "/bare").path == f"/bare?api_key={quote(QUERY_SECRET, safe='')}"


def test_basic_with_a_user_from_the_rule(penv: PlacementEnv) -> None:
    result = curl(penv.proxy, url(penv, "basic.test", "/basic"), "-u", "bot:placeholder")
    assert curl_status(result) == 200
    expected = base64.b64encode(f"bot:{BASIC_PASS}".encode()).decode()
    assert last(penv, "/basic").header("authorization") == [f"Basic {expected}"]


def test_basic_with_the_user_from_a_second_secret(penv: PlacementEnv) -> None:
    result = curl(penv.proxy, url(penv, "pair.test", "/pair"))
    assert curl_status(result) == 200
    expected = base64.b64encode(f"{BASIC_USER}:{BASIC_PASS}".encode()).decode()
    assert last(penv, "/pair").header("authorization") == [f"Basic {expected}"]


def test_a_placeholder_for_the_basic_user_secret_is_bound_where_its_rule_applies(
    penv: PlacementEnv,
) -> None:
    ok = curl(
        penv.proxy, url(penv, "pair.test", "/pair-ph"), "-u", "umbra-placeholder:team/basic-user:x"
    )
    assert curl_status(ok) == 200
    mark = penv.proxy.log.mark()
    refused = curl(penv.proxy, url(penv, "q.test", "/q-ph?user=umbra-placeholder:team/basic-user"))
    assert curl_status(refused) == 403
    penv.proxy.log.wait_for(mark, lambda r: r["reason"] == "placeholder_unbound")


def test_several_headers_from_one_rule_and_several_rules_on_one_request(
    penv: PlacementEnv,
) -> None:
    mark = penv.proxy.log.mark()
    result = curl(
        penv.proxy,
        url(penv, "multi.test", "/multi"),
        *("-H", "X-Api-Key: umbra-placeholder:team/multi-a", "-H", "x-api-key: second"),
    )
    assert curl_status(result) == 200
    seen = last(penv, "/multi")
    assert seen.header("x-api-key") == [MULTI_A]
    assert seen.header("x-api-sig") == [f"key={MULTI_A}"]
    assert seen.header("x-other-key") == [MULTI_B]
    record = penv.proxy.log.wait_for(mark, lambda r: r.get("path") == "/multi")
    assert sorted(record["injected_headers"]) == ["X-Api-Key", "X-Api-Sig", "X-Other-Key"]


def test_an_injection_bound_to_paths_goes_only_with_those_paths(penv: PlacementEnv) -> None:
    for target in ("/v1", "/v1/models", "/v1/a/b"):
        assert curl_status(curl(penv.proxy, url(penv, "paths.test", target))) == 200
        assert last(penv, target).header("authorization") == [f"Bearer {PATH_SECRET}"]
    for target in ("/v2/models", "/v1x", "/"):
        assert curl_status(curl(penv.proxy, url(penv, "paths.test", target))) == 200
        assert [s for s in penv.recorder.snapshot() if s.path == target][-1].header(
            "authorization"
        ) == []
    # A placeholder on a path the injection does not cover is refused, not forwarded.
    mark = penv.proxy.log.mark()
    refused = curl(
        penv.proxy,
        url(penv, "paths.test", "/v2/x"),
        *("-H", "Authorization: Bearer umbra-placeholder:team/path-key"),
    )
    assert curl_status(refused) == 403
    penv.proxy.log.wait_for(mark, lambda r: r["reason"] == "placeholder_unbound")


@pytest.mark.parametrize("target", ["/echo-path", "/echo-auth", "/echo-header"])
def test_an_origin_echoing_a_placed_form_is_cut(penv: PlacementEnv, target: str) -> None:
    """The query's URL-encoded value and the Basic base64 are each known to the reflection
    guard: echoed in the body or a header, the response never reaches the sandbox."""
    mark = penv.proxy.log.mark()
    result = curl(penv.proxy, url(penv, "echo.test", target))
    assert curl_status(result) != 200 or "you" not in result.stdout
    assert_no_secret_in(result.stdout)
    penv.proxy.log.wait_for(mark, lambda r: r["reason"] == "credential_reflected")


@pytest.mark.parametrize(
    ("host", "args"),
    [
        # the real value, as a query placement would place it, to its own bound host
        ("q.test", [f"/own?api_key={quote(QUERY_SECRET, safe='')}"]),
        # ... and to another host
        ("basic.test", [f"/other?k={quote(QUERY_SECRET, safe='')}"]),
        # the Basic credentials the proxy would build, sent by the sandbox itself
        ("multi.test", ["/real-basic", "-u", f"bot:{BASIC_PASS}"]),
        ("multi.test", ["/real-pair", "-u", f"{BASIC_USER}:{BASIC_PASS}"]),
    ],
)
def test_a_sandbox_sending_a_real_placed_form_is_refused(
    penv: PlacementEnv, host: str, args: list[str]
) -> None:
    mark = penv.proxy.log.mark()
    result = curl(penv.proxy, url(penv, host, args[0]), *args[1:])
    assert curl_status(result) == 403
    record = penv.proxy.log.wait_for(mark, lambda r: r["decision"] == "deny")
    assert any(rule.startswith("secret:team/") for rule in record["scan_rule_ids"])
    path = args[0].split("?")[0]
    assert not any(seen.path.split("?")[0] == path for seen in penv.recorder.snapshot())


def test_a_refused_dial_after_a_query_placement_leaks_nothing(penv: PlacementEnv) -> None:
    """The query is placed before the dial (proxy.md, check order); the 502, its record and the
    proxy's output (checked at teardown) carry no form of the secret."""
    mark = penv.proxy.log.mark()
    result = curl(
        penv.proxy, url(penv, "qdial.test", "/dial?api_key=umbra-placeholder:team/query-key")
    )
    assert curl_status(result) == 502
    assert_no_secret_in(result.stdout)
    record = penv.proxy.log.wait_for(mark, lambda r: r["reason"] == "address_private")
    assert_no_secret_in(json.dumps(record))


def test_query_placement_over_http2_from_the_sandbox(penv: PlacementEnv) -> None:
    result = curl(penv.proxy, url(penv, "q.test", "/h2?api_key=x"), "--http2", "-v")
    assert curl_status(result) == 200
    assert "using HTTP/2" in result.stderr or "HTTP/2 200" in result.stderr
    assert last(penv, "/h2").path == f"/h2?api_key={quote(QUERY_SECRET, safe='')}"
