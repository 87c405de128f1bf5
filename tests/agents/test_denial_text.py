"""The denial sentence for each kind of refusal (the real proxy's answers: test_denials.py)."""

from __future__ import annotations

import json

from tests.policy.helpers import policy, profile
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.denial import Advisor, Refused, render, sentence


def refused(reason: Reason, **overrides: object) -> Refused:
    fields: dict[str, object] = {
        "method": "GET", "scheme": "https", "host": "x.test", "port": 443, "path": "/p",
        "reason": reason, "detail": "", "rule_id": None, "profiles": ("a", "b"),
    }  # fmt: skip
    fields.update(overrides)
    return Refused(**fields)  # type: ignore[arg-type]


def test_no_profile_attached() -> None:
    text = sentence(refused(Reason.NO_POLICY, profiles=()))
    assert text.startswith(
        "umbra: denied (no_policy): GET https://x.test/p: no profile is attached"
    )
    assert "attached profiles: none" in text


def test_a_placeholder_sent_elsewhere_is_not_repeated() -> None:
    text = sentence(refused(Reason.PLACEHOLDER_UNBOUND, path="/u/umbra-placeholder:team/k"))
    assert "GET https://x.test: " in text and "/u/" not in text and "team/k" not in text
    assert "no injection binds to this host" in text


def test_a_long_path_is_cut_and_a_line_break_cannot_start_a_second_line() -> None:
    body, kind = render(
        refused(Reason.INVALID_PATH, path="/" + "a" * 500, detail="x\r\nforged: 1"),
        False,
        lambda text: text,
    )
    first, *rest = body.decode().splitlines()
    assert kind.startswith("text/plain") and len(first) < 400
    assert "/" + "a" * 119 + "..." in first and "a" * 120 not in first
    assert rest == ["reason: invalid_path"]


def test_a_personal_secret_names_the_personal_flag() -> None:
    text = sentence(
        refused(Reason.SECRET_UNAVAILABLE, rule_id="o:key", missing_secret="personal/openai")
    )
    assert "umbra secret set openai --personal --host x.test" in text


def test_json_keeps_the_fields() -> None:
    body, kind = render(refused(Reason.RULE_DENY, rule_id="a:no"), True, lambda text: text)
    document = json.loads(body)
    assert kind == "application/json" and document["error"] == document["message"]
    assert document["umbra"] == {
        "reason": "rule_deny", "rule_id": "a:no", "profiles": ["a", "b"], "candidates": [],
        "missing_secret": None,
    }  # fmt: skip


def test_the_advisor_names_only_profiles_that_would_allow_it() -> None:
    profiles = {
        "a": profile("a", [{"allow": {"hosts": ["a.test"]}}]),
        "npm": profile("npm", [{"allow": {"hosts": ["registry.npmjs.org"], "methods": ["GET"]}}]),
        "pypi": profile("pypi", [{"allow": {"hosts": ["pypi.org"]}}]),
    }
    composed: list[list[str]] = []

    def compose(names: list[str]):  # type: ignore[no-untyped-def]
        composed.append(names)
        return policy(*(profiles[name] for name in names))

    advisor = Advisor()
    request = ("GET", "https", "registry.npmjs.org", 443, "/left-pad")
    assert advisor.candidates(1, sorted(profiles), compose, ("a",), request) == ("npm",)
    post = ("POST", "https", "registry.npmjs.org", 443, "/left-pad")
    assert advisor.candidates(1, sorted(profiles), compose, ("a",), post) == ()
    assert composed == [["npm"], ["pypi"]], "each profile is composed once per generation"
    advisor.candidates(2, sorted(profiles), compose, ("a",), request)
    assert len(composed) == 4
