"""Composition: allows union, deny wins, conflicts are errors, built-in scans always present."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.policy.helpers import policy, profile
from umbra.policy.builtin_scan import BUILTIN_SCAN_RULES
from umbra.policy.compose import CompositionError, EffectivePolicy, deny_all
from umbra.policy.matcher import Reason

AUTH = {
    "header": "Authorization",
    "format": "Bearer {secret}",
    "secret": "team/bot",
    "hosts": ["api.x.com"],
}


def test_allows_union_across_profiles_and_deny_from_any_profile_wins() -> None:
    a = profile("a", [{"allow": {"hosts": ["a.com"]}}, {"allow": {"hosts": ["shared.com"]}}])
    b = profile(
        "b",
        [{"allow": {"hosts": ["b.com"]}}, {"deny": {"hosts": ["shared.com"], "methods": ["POST"]}}],
    )
    p = policy(a, b)
    assert p.decide("GET", "https", "a.com", 443, "/").allowed
    assert p.decide("GET", "https", "b.com", 443, "/").allowed
    assert p.decide("GET", "https", "shared.com", 443, "/").allowed
    denied = p.decide("POST", "https", "shared.com", 443, "/")
    assert (denied.reason, denied.rule_id) == (Reason.RULE_DENY, "b:egress-1")


def test_no_profile_denies_everything() -> None:
    empty = deny_all()
    decision = empty.decide("GET", "https", "pypi.org", 443, "/simple/")
    assert not decision.allowed and decision.reason is Reason.NO_POLICY
    assert empty.decide_tunnel("github.com", 22).reason is Reason.NO_POLICY
    assert empty.injections_for("pypi.org", 443) == ()


def test_builtin_scan_rules_are_always_present() -> None:
    ids = {rule.id for rule in deny_all().scan_rules}
    assert set(BUILTIN_SCAN_RULES) <= ids
    custom = profile("c", scan=[{"id": "mine", "regex": "acme_[a-z]{8}"}])
    assert {"c:mine", *BUILTIN_SCAN_RULES} == {rule.id for rule in policy(custom).scan_rules}


def test_two_injections_of_one_header_for_one_host_do_not_compose() -> None:
    allow = [{"allow": {"hosts": ["api.x.com"]}}]
    first = profile("first", allow, inject=[AUTH])
    second = profile(
        "second", inject=[{**AUTH, "secret": "personal/mine", "header": "authorization"}]
    )
    with pytest.raises(CompositionError) as excinfo:
        policy(first, second)
    [conflict] = excinfo.value.conflicts
    assert conflict.rule_id == "second:inject-0"
    assert "first:inject-0" in conflict.message


def test_an_injection_needs_an_allow_rule_that_reaches_its_host() -> None:
    with pytest.raises(CompositionError, match="no HTTPS allow rule of its profile reaches"):
        policy(profile("lonely", inject=[AUTH]))
    # Another profile's allow does not count: an injection applies to its own profile's grants.
    grants = profile("grants", [{"allow": {"hosts": ["api.x.com"]}}])
    with pytest.raises(CompositionError, match="lonely:inject-0"):
        policy(grants, profile("lonely", inject=[AUTH]))
    wildcard = profile("w", [{"allow": {"hosts": ["*.x.com"]}}], inject=[AUTH])
    assert [rule.id for rule in policy(wildcard).injections_for("API.x.com.", 443)] == [
        "w:inject-0"
    ]


def test_injections_are_bound_to_their_ports() -> None:
    """The demo profile's credential for api.demo.test went to api.demo.test:7095 too: an
    injection applies on its rule's ports only (default 443), never on another port of the host."""
    allow = [{"allow": {"hosts": ["api.x.com"], "ports": [443, 7095]}}]
    default = policy(profile("d", allow, inject=[AUTH]))
    assert [rule.id for rule in default.injections_for("api.x.com", 443)] == ["d:inject-0"]
    assert default.injections_for("api.x.com", 7095) == ()
    bound = policy(profile("b", allow, inject=[{**AUTH, "ports": [7095]}]))
    assert bound.injections_for("api.x.com", 443) == ()
    assert [rule.id for rule in bound.injections_for("api.x.com", 7095)] == ["b:inject-0"]
    [compiled] = bound.profiles
    assert compiled.inject[0].ports == [7095]


def test_an_injection_on_a_port_no_https_rule_reaches_does_not_compose() -> None:
    """An allow on another port (or plain HTTP only) does not make an injection reachable."""
    on_other_port = [{"allow": {"hosts": ["api.x.com"], "ports": [7443]}}]
    with pytest.raises(
        CompositionError, match="on port 443, which no HTTPS allow rule of its profile reaches"
    ):
        policy(profile("p", on_other_port, inject=[AUTH]))
    plain_only = [{"allow": {"hosts": ["api.x.com"], "schemes": ["http"], "ports": [8080]}}]
    with pytest.raises(CompositionError, match="on port 8080"):
        policy(profile("q", plain_only, inject=[{**AUTH, "ports": [8080]}]))


def test_the_same_header_on_different_ports_of_a_host_composes() -> None:
    allow = [{"allow": {"hosts": ["api.x.com"], "ports": [443, 8443]}}]
    p = policy(
        profile("a", allow, inject=[AUTH]),
        profile(
            "b",
            [{"allow": {"hosts": ["api.x.com"], "ports": [8443]}}],
            inject=[{**AUTH, "secret": "team/other", "ports": [8443]}],
        ),
    )
    assert [rule.secret for rule in p.injections_for("api.x.com", 8443)] == ["team/other"]


def test_a_profile_twice_is_a_conflict() -> None:
    a = profile("a", [{"allow": {"hosts": ["a.com"]}}])
    with pytest.raises(CompositionError, match="profile appears twice"):
        policy(a, a)


def test_injections_are_bound_to_their_exact_hosts() -> None:
    p = policy(profile("i", [{"allow": {"hosts": ["*.x.com"]}}], inject=[AUTH]))
    assert [rule.placements for rule in p.injections_for("api.x.com", 443)] == [["Authorization"]]
    assert p.injections_for("other.x.com", 443) == ()
    assert p.injections_for("evil.api.x.com", 443) == ()
    assert p.injections_for("not a host", 443) == ()


def test_the_hash_is_independent_of_order_and_changes_with_content() -> None:
    a = profile("a", [{"allow": {"hosts": ["a.com", "b.com"], "methods": ["POST", "GET"]}}])
    a_reordered = profile(
        "a", [{"allow": {"hosts": ["b.com", "a.com"], "methods": ["GET", "POST"]}}]
    )
    b = profile("b", [{"allow": {"hosts": ["c.com"]}}])
    assert policy(a, b).hash == policy(b, a_reordered).hash
    assert policy(a, b).hash != policy(a).hash
    assert policy(a).hash.startswith("sha256:")


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("Bearer {secret}", "Bearer s3cr3t"),
        ("{secret}", "s3cr3t"),
        ("Basic {basic:x-access-token}", "Basic eC1hY2Nlc3MtdG9rZW46czNjcjN0"),
    ],
)
def test_injected_values_render_from_the_format(fmt: str, expected: str) -> None:
    p = policy(
        profile("r", [{"allow": {"hosts": ["api.x.com"]}}], inject=[{**AUTH, "format": fmt}])
    )
    [rule] = p.injections_for("api.x.com", 443)
    assert rule.render("s3cr3t") == [("Authorization", expected)]


def test_a_secret_with_a_line_break_is_never_rendered_into_a_header() -> None:
    p = policy(profile("r", [{"allow": {"hosts": ["api.x.com"]}}], inject=[AUTH]))
    [rule] = p.injections_for("api.x.com", 443)
    with pytest.raises(ValueError, match="control character") as excinfo:
        rule.render("abc\r\nX-Evil: 1")
    assert "abc" not in str(excinfo.value)


def test_push_refs_limit_the_refs_a_git_push_may_change() -> None:
    from umbra.policy import decide_push

    push = {"allow": {"hosts": ["git.x.com"], "methods": ["POST"]}}
    limited = policy(profile("g", [{**push, "push_refs": ["refs/heads/agent/**"]}]))
    decision = limited.decide("POST", "https", "git.x.com", 443, "/r.git/git-receive-pack")
    assert decision.push_refs == ("refs/heads/agent/**",)
    assert decide_push(decision, ["refs/heads/agent/a", "refs/heads/agent/b/c"]).allowed
    refused = decide_push(decision, ["refs/heads/agent/a", "refs/heads/main"])
    assert (refused.reason, refused.rule_id) == (Reason.PUSH_REF_DENIED, "g:egress-0")
    assert not decide_push(decision, ["refs/tags/v1"]).allowed
    # allows are a union: another matching allow without limits allows any ref
    both = policy(
        profile("g", [{**push, "push_refs": ["refs/heads/agent/**"]}]),
        profile("h", [{"allow": {"hosts": ["git.x.com"]}}]),
    )
    open_decision = both.decide("POST", "https", "git.x.com", 443, "/r.git/git-receive-pack")
    assert open_decision.push_refs is None
    assert decide_push(open_decision, ["refs/heads/main"]).allowed


def test_an_injection_goes_only_with_the_requests_its_profile_allows() -> None:
    """Fails on the old code, which injected a profile's credential into every request to the
    host, whichever profile allowed it (and denied them all when the secret was not set)."""
    keyed = profile(
        "keyed",
        [{"allow": {"hosts": ["api.x.com"], "methods": ["POST"], "paths": ["/v1/**"]}}],
        inject=[AUTH],
    )
    public = profile("public", [{"allow": {"hosts": ["api.x.com"], "paths": ["/public/**"]}}])
    p = policy(keyed, public)
    own = p.decide("POST", "https", "api.x.com", 443, "/v1/write")
    assert own.allowed_by == ("keyed",)
    assert [rule.id for rule in p.applicable_injections("api.x.com", 443, own)] == [
        "keyed:inject-0"
    ]
    other = p.decide("GET", "https", "api.x.com", 443, "/public/readme")
    assert other.allowed and other.allowed_by == ("public",)
    assert p.applicable_injections("api.x.com", 443, other) == ()
    denied = p.decide("DELETE", "https", "api.x.com", 443, "/v1/write")
    assert p.applicable_injections("api.x.com", 443, denied) == ()


def _paths_policy() -> EffectivePolicy:
    return policy(
        profile(
            "p",
            [{"allow": {"hosts": ["api.x.com"]}}],
            inject=[
                {**AUTH, "paths": ["/v1/**"]},
                {"query": "key", "secret": "team/q", "hosts": ["api.x.com"], "paths": ["/q/*"]},
            ],
        )
    )


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1", ["Authorization"]),
        ("/v1/models?x=1", ["Authorization"]),
        ("/v1/a%2Fb", ["Authorization"]),  # both readings stay under /v1/**
        ("/v1x", []),
        ("/v2/v1", []),
        ("/q/a", ["?key"]),
        ("/q/a/b", []),
        # the split reading /q/a/b is outside /q/*: not injected, though the literal one is inside
        ("/q/a%2Fb", []),
        ("/", []),
    ],
)
def test_an_injection_bound_to_paths_applies_on_those_paths_only(
    path: str, expected: list[str]
) -> None:
    p = _paths_policy()
    decision = p.decide("GET", "https", "api.x.com", 443, path)
    assert decision.allowed
    placements = [
        x for rule in p.applicable_injections("api.x.com", 443, decision) for x in rule.placements
    ]
    assert placements == expected


def test_basic_placements_render_with_a_given_user_or_a_user_secret() -> None:
    p = policy(
        profile(
            "b",
            [{"allow": {"hosts": ["a.x.com", "b.x.com"]}}],
            inject=[
                {"basic": {"user": "bot"}, "secret": "team/p", "hosts": ["a.x.com"]},
                {"basic": {"user_secret": "team/u"}, "secret": "team/p", "hosts": ["b.x.com"]},
            ],
        )
    )
    [given] = p.injections_for("a.x.com", 443)
    [paired] = p.injections_for("b.x.com", 443)
    assert given.render("s3cr3t") == [("Authorization", "Basic Ym90OnMzY3IzdA==")]
    assert paired.refs == ["team/p", "team/u"]
    assert paired.render("s3cr3t", "bot") == [("Authorization", "Basic Ym90OnMzY3IzdA==")]
    # a user value that cannot be a Basic user (':' would move the split) is never rendered
    with pytest.raises(ValueError, match="not a Basic user name"):
        paired.render("s3cr3t", "a:b")


def test_several_headers_and_rules_compose_on_one_request_without_conflict() -> None:
    p = policy(
        profile(
            "m",
            [{"allow": {"hosts": ["api.x.com"]}}],
            inject=[
                {
                    "headers": [
                        {"header": "X-Key", "format": "{secret}"},
                        {"header": "X-Sig", "format": "k={secret}"},
                    ],
                    "secret": "team/a",
                    "hosts": ["api.x.com"],
                },
                {**AUTH, "secret": "team/b"},
                {"query": "key", "secret": "team/c", "hosts": ["api.x.com"]},
            ],
        )
    )
    decision = p.decide("GET", "https", "api.x.com", 443, "/")
    placements = [
        x for rule in p.applicable_injections("api.x.com", 443, decision) for x in rule.placements
    ]
    assert placements == ["X-Key", "X-Sig", "Authorization", "?key"]


def test_a_basic_placement_conflicts_with_an_authorization_header() -> None:
    with pytest.raises(
        CompositionError, match=r"injects header 'Authorization' for api\.x\.com:443"
    ):
        policy(
            profile(
                "c",
                [{"allow": {"hosts": ["api.x.com"]}}],
                inject=[AUTH, {"basic": {"user": "u"}, "secret": "team/p", "hosts": ["api.x.com"]}],
            )
        )


def test_widening_an_injections_paths_or_adding_a_placement_shows_in_the_diff(
    tmp_path: Path,
) -> None:
    from umbra.policy.diff import diff_policy_sets
    from umbra.policy.loader import load_policy_dir

    def version(name: str, inject: str) -> Path:
        root = tmp_path / name
        root.mkdir()
        (root / "p.yaml").write_text(
            "apiVersion: umbra/v1\nkind: Profile\nname: p\n"
            "egress:\n  - allow: {hosts: [x.com]}\ninject:\n" + inject
        )
        return root

    narrow = version(
        "a", "  - {id: k, query: key, secret: team/k, hosts: [x.com], paths: ['/v1/**']}\n"
    )
    wide = version("b", "  - {id: k, query: key, secret: team/k, hosts: [x.com]}\n")
    more = version(
        "c",
        "  - {id: k, headers: [{header: X-K, format: '{secret}'}, {header: X-L, format: '{secret}'}],"
        " secret: team/k, hosts: [x.com]}\n",
    )
    widened = diff_policy_sets(load_policy_dir(narrow), load_policy_dir(wide))
    assert widened.widens
    assert [change.grant[1:5] for change in widened.added] == [("?key", "for", "x.com:443", "/**")]
    placements = diff_policy_sets(load_policy_dir(wide), load_policy_dir(more))
    assert sorted(change.grant[1] for change in placements.added) == ["X-K", "X-L"]
