"""An encoded slash in a request path (npm's `GET /@scope%2fname`): matched by the rule a user
writes, never a way past a rule. Each case fails on the old code, which refused every `%2F`."""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.policy.helpers import policy, profile
from umbra.policy import NormalizationError, normalize_path, normalize_request_path
from umbra.policy.matcher import Reason, Verdict


def allow(**match: Any) -> dict[str, Any]:
    return {"allow": match}


def deny(**match: Any) -> dict[str, Any]:
    return {"deny": match}


NPM = policy(
    profile(
        "npm",
        [
            allow(hosts=["registry.npmjs.org"], methods=["GET", "HEAD"]),
            deny(hosts=["registry.npmjs.org"], paths=["/-/user/**", "/-/npm/v1/tokens/**"]),
        ],
    )
)


@pytest.mark.parametrize("path", ["/@anthropic-ai%2fclaude-code", "/@anthropic-ai%2Fclaude-code"])
def test_a_scoped_package_matches_the_rules_a_user_writes(path: str) -> None:
    decision = NPM.decide("GET", "https", "registry.npmjs.org", 443, path)
    assert decision.allowed and decision.reason is Reason.RULE_ALLOW
    # The logged path keeps the slash encoded (the form the registry is sent), in one spelling.
    assert decision.path == "/@anthropic-ai%2Fclaude-code"
    scoped = policy(
        profile("s", [allow(hosts=["registry.npmjs.org"], paths=["/@anthropic-ai/**"])])
    )
    assert scoped.decide("GET", "https", "registry.npmjs.org", 443, path).allowed
    assert not scoped.decide("GET", "https", "registry.npmjs.org", 443, "/@evil%2fpkg").allowed
    assert not scoped.decide(
        "GET", "https", "registry.npmjs.org", 443, "/@anthropic-aix%2fp"
    ).allowed


@pytest.mark.parametrize(
    "path",
    [
        "/-%2fuser%2forg.couchdb.user:bob",  # the deny, spelled with encoded slashes
        "/-%2Fnpm/v1%2ftokens/x",
        "/-/npm%2Fv1/tokens",
    ],
)
def test_an_encoded_slash_does_not_slip_past_a_deny(path: str) -> None:
    decision = NPM.decide("GET", "https", "registry.npmjs.org", 443, path)
    assert decision.reason is Reason.RULE_DENY


def test_a_deny_on_one_segment_also_holds_for_the_literal_reading() -> None:
    # A server that keeps `%2F` inside the segment serves `/a/<x/y>`, which `/a/*` denies.
    p = policy(profile("l", [allow(hosts=["x.com"]), deny(hosts=["x.com"], paths=["/a/*"])]))
    assert p.decide("GET", "https", "x.com", 443, "/a/x").reason is Reason.RULE_DENY
    assert p.decide("GET", "https", "x.com", 443, "/a/x%2Fy").reason is Reason.RULE_DENY
    assert p.decide("GET", "https", "x.com", 443, "/a/x/y").allowed


def test_an_allow_needs_the_split_reading() -> None:
    # `/pkg/*` grants one segment; `/pkg/a%2Fb` is two to a server that splits it.
    p = policy(profile("o", [allow(hosts=["x.com"], paths=["/pkg/*", "/a/b"])]))
    assert not p.decide("GET", "https", "x.com", 443, "/pkg/a%2Fb").allowed
    assert p.decide("GET", "https", "x.com", 443, "/pkg/a").allowed
    # `/a%2Fb` is `/a/b` to a server that splits; one that does not serves the resource `a/b`,
    # which is still the name the rule wrote.
    assert p.decide("GET", "https", "x.com", 443, "/a%2Fb").allowed


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/allowed%2f..%2fsecret", "dot segment"),
        ("/allowed%2F.%2Fsecret", "dot segment"),
        ("/allowed%2f..;x%2fsecret", "dot segment"),
        ("/allowed/..%2fsecret", "dot segment"),
        ("/allowed/x%2fy/../../secret", "dot segment"),
        ("/allowed/./x%2fy", "dot segment"),
        ("/allowed%2f%2e%2e%2fsecret", "dot segment"),
        ("/allowed%252fsecret", "double"),
        ("/allowed%252Fsecret", "double"),
        ("/allowed%2f%2fsecret", "empty"),
        ("/%2fsecret", "empty"),
        ("/allowed%2f", "empty"),
        ("/allowed%5csecret", "'\\'"),
        ("/allowed%00secret", "NUL"),
    ],
)
def test_smuggling_spellings_are_refused(path: str, why: str) -> None:
    p = policy(profile("a", [allow(hosts=["x.com"], paths=["/allowed/**", "/**"])]))
    decision = p.decide("GET", "https", "x.com", 443, path)
    assert decision.verdict is Verdict.DENY and decision.reason is Reason.INVALID_PATH
    assert why in decision.detail


def test_rules_are_still_written_with_real_slashes() -> None:
    with pytest.raises(NormalizationError, match="encoded '/'"):
        normalize_path("/@scope%2Fname")
    with pytest.raises(ValueError, match="encoded '/'"):
        profile("r", [allow(hosts=["x.com"], paths=["/@scope%2Fname"])])


def test_request_path_readings() -> None:
    plain = normalize_request_path("/a/./b/%7e")
    assert plain.canonical == "/a/b/~" and plain.segments == ("a", "b", "~")
    assert plain.literal_segments is None
    scoped = normalize_request_path("/@s%2fn/-/n-1.0.0.tgz")
    assert scoped.canonical == "/@s%2Fn/-/n-1.0.0.tgz"
    assert scoped.segments == ("@s", "n", "-", "n-1.0.0.tgz")
    assert scoped.literal_segments == ("@s%2Fn", "-", "n-1.0.0.tgz")


# ----------------------------------------------------------------- against a reference

PIECES = ["a", "b", "x", "..", ".", "", "%2F", "%2f", "%252F", "%2e", "*", ";"]
PATTERNS = ["/**", "/a/**", "/a/b", "/a/*", "/a/b/**", "/*", "/x/**", "/a/*/x", "/b"]


def _segments_match(pattern: list[str], segments: list[str]) -> bool:
    if not pattern:
        return not segments
    if pattern[0] == "**":
        return any(_segments_match(pattern[1:], segments[i:]) for i in range(len(segments) + 1))
    return (
        bool(segments)
        and fnmatchcase(segments[0], pattern[0])
        and _segments_match(pattern[1:], segments[1:])
    )


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=7).map("".join),
    st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=2),
    st.lists(st.sampled_from(PATTERNS), min_size=0, max_size=2),
)
def test_an_allowed_path_is_allowed_under_every_reading_a_server_may_take(
    body: str, allows: list[str], denies: list[str]
) -> None:
    """Whatever the request: if it is allowed, then the path a splitting server sees (every `%2F`
    a `/`) is granted by an allow rule, neither that path nor the one a non-splitting server sees
    is named by a deny, and neither reading contains a dot or empty segment."""
    raw = "/" + body.replace(";", "/")
    egress = [allow(hosts=["x.com"], paths=allows)]
    if denies:
        egress.append(deny(hosts=["x.com"], paths=denies))
    decision = policy(profile("p", egress)).decide("GET", "https", "x.com", 443, raw)
    if not decision.allowed:
        return
    decoded = re.sub("%2[fF]", "/", raw)
    split = normalize_path(decoded)[1:].split("/")  # what a server that splits at %2F serves
    if decoded != raw:
        pieces = decoded.replace("%2e", ".")[1:].split("/")
        assert "." not in pieces and ".." not in pieces and "" not in pieces[:-1]
    literal = (decision.path or "")[1:].split("/")
    assert any(_segments_match(p[1:].split("/"), split) for p in allows)
    for pattern in denies:
        assert not _segments_match(pattern[1:].split("/"), split)
        assert not _segments_match(pattern[1:].split("/"), literal)
