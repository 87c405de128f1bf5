"""The policy package speaks the contracts' vocabulary: allow/deny is `contracts.traffic.Decision`
in the compiled rules, the test suites and the matcher's verdicts, not a `Literal` or a second enum
of its own (the old code had both)."""

from __future__ import annotations

import re
from pathlib import Path

from umbra.contracts.traffic import Decision
from umbra.policy import Verdict
from umbra.policy.compiled import CompiledHttpRule
from umbra.policy.suite import Case

PACKAGE = Path(__file__).resolve().parents[2] / "policy"
OLD = [
    re.compile(r"Literal\[\s*\"(allow|deny)\""),  # the Literal spelling of the decision
    re.compile(r"[=!]=\s*\"(allow|deny)\""),  # a comparison with the bare string
    re.compile(r"^\s*(ALLOW|DENY)\s*=\s*\"(allow|deny)\"", re.MULTILINE),  # an enum of its own
]


def test_no_decision_literal_is_left_in_the_package() -> None:
    found = [
        f"{path.name}: {match.group(0).strip()}"
        for path in sorted(PACKAGE.glob("*.py"))
        for pattern in OLD
        for match in pattern.finditer(path.read_text())
    ]
    assert found == []


def test_the_verdict_is_the_traffic_decision() -> None:
    assert Verdict is Decision


def test_documents_still_spell_it_as_a_string_and_get_the_enum() -> None:
    case = Case.model_validate({"request": "GET https://example.com/", "expect": "deny"})
    assert case.expect is Decision.DENY
    rule = CompiledHttpRule.model_validate(
        {"id": "p:r", "action": "allow", "hosts": ["example.com"], "methods": None,
         "endpoints": ["https:443"], "paths": None, "push_refs": None}
    )  # fmt: skip
    assert rule.action is Decision.ALLOW
    assert rule.model_dump(mode="json")["action"] == "allow"
