"""The matcher's decisions, checked by example and against a naive reference implementation."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.policy.helpers import policy, profile
from umbra.policy.compiled import CompiledHttpRule
from umbra.policy.compose import EffectivePolicy, deny_all
from umbra.policy.matcher import Reason, Verdict
from umbra.policy.normalize import is_ip_literal, normalize_host, normalize_path


def allow(**match: Any) -> dict[str, Any]:
    return {"allow": match}


def deny(**match: Any) -> dict[str, Any]:
    return {"deny": match}


def test_wildcard_matches_subdomains_at_any_depth_but_not_the_apex() -> None:
    p = policy(profile("w", [allow(hosts=["*.example.com"])]))
    assert p.decide("GET", "https", "a.example.com", 443, "/").allowed
    assert p.decide("GET", "https", "a.b.example.com", 443, "/").allowed
    apex = p.decide("GET", "https", "example.com", 443, "/")
    assert apex.verdict is Verdict.DENY and apex.reason is Reason.NO_MATCHING_RULE
    assert not p.decide("GET", "https", "badexample.com", 443, "/").allowed
    assert not p.decide("GET", "https", "example.com.evil.net", 443, "/").allowed


def test_deny_wins_over_allow_whatever_the_order() -> None:
    rules = [allow(hosts=["api.example.com"]), deny(hosts=["api.example.com"], paths=["/admin/**"])]
    for ordered in (rules, rules[::-1]):
        p = policy(profile("d", ordered))
        decision = p.decide("GET", "https", "api.example.com", 443, "/admin/users")
        assert decision.verdict is Verdict.DENY and decision.reason is Reason.RULE_DENY
        assert p.decide("GET", "https", "api.example.com", 443, "/public").allowed


def test_methods_ports_and_schemes_scope_a_rule() -> None:
    p = policy(profile("m", [allow(hosts=["x.com"], methods=["GET"], schemes=["http", "https"])]))
    assert p.decide("GET", "https", "x.com", 443, "/").allowed
    assert p.decide("GET", "http", "x.com", 80, "/").allowed
    assert not p.decide("GET", "http", "x.com", 443, "/").allowed, (
        "defaults pair each scheme with its port"
    )
    assert not p.decide("GET", "https", "x.com", 8443, "/").allowed
    assert not p.decide("POST", "https", "x.com", 443, "/").allowed
    explicit = policy(profile("p", [allow(hosts=["x.com"], ports=[8443])]))
    assert explicit.decide("GET", "https", "x.com", 8443, "/").allowed
    assert not explicit.decide("GET", "https", "x.com", 443, "/").allowed


def test_path_globs() -> None:
    p = policy(
        profile("g", [allow(hosts=["x.com"], paths=["/repos/acme/**", "/u/*/keys", "/f/*.txt"])])
    )

    def ok(path: str) -> bool:
        return p.decide("GET", "https", "x.com", 443, path).allowed

    assert ok("/repos/acme") and ok("/repos/acme/") and ok("/repos/acme/a/b/c")
    assert not ok("/repos/acmex") and not ok("/repos/other/acme")
    assert ok("/u/bob/keys") and not ok("/u/bob/x/keys")
    assert ok("/f/a.txt") and not ok("/f/a.txt/b") and not ok("/f/a.txtx")
    assert ok("/repos/acme/../acme/x")
    assert not ok("/repos/acme/../other")
    assert ok("/repos/acme/x?next=/other")


def test_ip_literal_rules_match_only_that_address() -> None:
    p = policy(profile("ip", [allow(hosts=["10.1.2.3", "[2001:db8::1]"])]))
    assert p.decide("GET", "https", "10.1.2.3", 443, "/").allowed
    assert p.decide("GET", "https", "[2001:DB8:0::1]", 443, "/").allowed
    assert not p.decide("GET", "https", "10.1.2.4", 443, "/").allowed
    assert not p.decide("GET", "https", "0x0a.1.2.3", 443, "/").allowed


def test_any_host_deny_covers_everything_it_names() -> None:
    p = policy(profile("a", [allow(hosts=["x.com"]), deny(hosts=["*"], methods=["DELETE"])]))
    assert p.decide("GET", "https", "x.com", 443, "/").allowed
    assert p.decide("DELETE", "https", "x.com", 443, "/").reason is Reason.RULE_DENY


@pytest.mark.parametrize(
    ("method", "scheme", "host", "port", "path", "reason"),
    [
        ("get", "https", "x.com", 443, "/", Reason.INVALID_METHOD),
        ("G ET", "https", "x.com", 443, "/", Reason.INVALID_METHOD),
        ("GET", "ftp", "x.com", 443, "/", Reason.INVALID_SCHEME),
        ("GET", "https", "x.com", 0, "/", Reason.INVALID_PORT),
        ("GET", "https", "x.com", 70000, "/", Reason.INVALID_PORT),
        ("GET", "https", "x..com", 443, "/", Reason.INVALID_HOST),
        ("GET", "https", "127.1", 443, "/", Reason.INVALID_HOST),
        ("GET", "https", "x.com", 443, "/a/%2e%2e/b", Reason.INVALID_PATH),
        ("GET", "https", "x.com", 443, "relative", Reason.INVALID_PATH),
    ],
)
def test_malformed_requests_are_denied_with_a_reason(
    method: str, scheme: str, host: str, port: int, path: str, reason: Reason
) -> None:
    p = policy(profile("open", [allow(hosts=["x.com"])]))
    decision = p.decide(method, scheme, host, port, path)
    assert decision.verdict is Verdict.DENY
    assert decision.reason is reason
    assert decision.detail


def test_tunnels_are_exact_host_and_port() -> None:
    p = policy(profile("t", [{"tunnel": {"hosts": ["github.com"], "ports": [22]}}]))
    assert p.decide_tunnel("GitHub.com.", 22).allowed
    assert not p.decide_tunnel("github.com", 443).allowed
    assert not p.decide_tunnel("gitlab.com", 22).allowed
    assert not p.decide("GET", "https", "github.com", 443, "/").allowed, "a tunnel grants no HTTP"


# Reference implementation: a linear scan with independently written matching, for comparison.
def _reference(
    rules: list[CompiledHttpRule], method: str, host: str, endpoint: str, path: str
) -> str | None:
    host = normalize_host(host)
    segments = normalize_path(path)[1:].split("/")

    def host_ok(pattern: str) -> bool:
        if pattern in ("*", host):
            return True
        return pattern.startswith("*.") and not is_ip_literal(host) and host.endswith(pattern[1:])

    def segs_ok(pats: list[str], segs: list[str]) -> bool:
        if not pats:
            return not segs
        if pats[0] == "**":
            return any(segs_ok(pats[1:], segs[i:]) for i in range(len(segs) + 1))
        return bool(segs) and fnmatchcase(segs[0], pats[0]) and segs_ok(pats[1:], segs[1:])

    def rule_ok(rule: CompiledHttpRule) -> bool:
        return (
            any(host_ok(h) for h in rule.hosts)
            and endpoint in rule.endpoints
            and (rule.methods is None or method in rule.methods)
            and (rule.paths is None or any(segs_ok(p[1:].split("/"), segments) for p in rule.paths))
        )

    matching = [rule for rule in rules if rule_ok(rule)]
    denies = [rule for rule in matching if rule.action == "deny"]
    allows = [rule for rule in matching if rule.action == "allow"]
    return (denies or allows or [None])[
        0
    ] and f"{(denies or allows)[0].action}:{(denies or allows)[0].id}"


HOST_PATTERNS = ["a.com", "b.a.com", "*.a.com", "c.b.a.com", "*.b.a.com", "x.org", "10.0.0.1"]
PATH_PATTERNS = ["/", "/x", "/x/**", "/x/*", "/x/*/y", "/**", "/x/y*", "/*/y", "/**/y", "/x/**/z"]
REQUEST_HOSTS = ["a.com", "b.a.com", "c.b.a.com", "d.c.b.a.com", "x.org", "y.x.org", "10.0.0.1"]
REQUEST_PATHS = ["/", "/x", "/x/", "/x/y", "/x/y/z", "/x/yy", "/q/y", "/x/a/y", "/x/a/b/z", "/y"]

rule_strategy = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["allow", "allow", "deny"]),
        "hosts": st.lists(st.sampled_from(HOST_PATTERNS), min_size=1, max_size=3),
        "methods": st.none()
        | st.lists(st.sampled_from(["GET", "POST", "PUT"]), min_size=1, max_size=2),
        "schemes": st.lists(st.sampled_from(["https", "http"]), min_size=1, max_size=2),
        "paths": st.none() | st.lists(st.sampled_from(PATH_PATTERNS), min_size=1, max_size=3),
    }
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(rule_strategy, min_size=1, max_size=8),
    st.lists(
        st.tuples(
            st.sampled_from(["GET", "POST", "PUT"]),
            st.sampled_from(["https:443", "http:80", "https:80"]),
            st.sampled_from(REQUEST_HOSTS),
            st.sampled_from(REQUEST_PATHS),
        ),
        min_size=1,
        max_size=10,
    ),
)
def test_matcher_agrees_with_linear_reference(
    rules: list[dict[str, Any]], requests: list[tuple[str, str, str, str]]
) -> None:
    egress = []
    for rule in rules:
        match = {key: value for key, value in rule.items() if key != "kind" and value is not None}
        egress.append({rule["kind"]: match})
    p: EffectivePolicy = policy(profile("r", egress))
    for method, endpoint, host, path in requests:
        scheme, port = endpoint.split(":")
        decision = p.decide(method, scheme, host, int(port), path)
        expected = _reference(list(p.rules), method, host, endpoint, path)
        actual = f"{decision.verdict}:{decision.rule_id}" if decision.rule_id else None
        assert actual == expected, (method, endpoint, host, path)


@given(st.sampled_from(REQUEST_HOSTS), st.sampled_from(REQUEST_PATHS), st.booleans())
def test_decisions_do_not_depend_on_spelling(host: str, path: str, upper: bool) -> None:
    p = policy(profile("s", [allow(hosts=["*.a.com"], paths=["/x/**"]), deny(hosts=["c.b.a.com"])]))
    canonical = p.decide("GET", "https", host, 443, path)
    variant_host = (host.upper() if upper else host) + ("" if is_ip_literal(host) else ".")
    variant_path = path.replace("/x", "/x/./q/..", 1) if path.startswith("/x") else path
    variant = p.decide("GET", "https", variant_host, 443, variant_path)
    assert (variant.verdict, variant.rule_id) == (canonical.verdict, canonical.rule_id)


@pytest.mark.parametrize("method", ["TRACE", "CONNECT", "PRI", "PROPFIND", "BREW"])
def test_a_rule_without_methods_never_admits_methods_no_rule_could_name(method: str) -> None:
    p = policy(profile("any", [allow(hosts=["x.com"])]))
    decision = p.decide(method, "https", "x.com", 443, "/")
    assert decision.reason is Reason.INVALID_METHOD
    assert p.decide("DELETE", "https", "x.com", 443, "/").allowed


def test_may_connect_answers_whether_any_rule_could_admit_a_host_and_port() -> None:
    p = policy(
        profile(
            "c",
            [
                allow(hosts=["*.a.com"], methods=["GET"], paths=["/only/**"]),
                allow(hosts=["plain.org"], schemes=["http"]),
                {"tunnel": {"hosts": ["git.b.com"], "ports": [22]}},
                deny(hosts=["*"], methods=["DELETE"]),
            ],
        )
    )
    assert p.may_connect("x.a.com", 443)
    assert p.may_connect("X.A.COM.", 443)
    assert not p.may_connect("a.com", 443)
    assert not p.may_connect("x.a.com", 8443)
    assert p.may_connect("plain.org", 80)
    assert not p.may_connect("plain.org", 443)
    assert p.may_connect("git.b.com", 22)
    assert not p.may_connect("git.b.com", 443)
    assert not p.may_connect("elsewhere.net", 443), "a deny on '*' admits nothing"
    assert not p.may_connect("bad..host", 443)
    assert not deny_all().may_connect("x.a.com", 443)
