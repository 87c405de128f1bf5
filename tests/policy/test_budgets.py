"""Budgets in the policy engine: the file format and its errors, which budgets cover a request,
counters per fixed UTC window (reached, then reset by the next window), saving and loading them,
`policy test` cases and `policy diff`."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.policy.helpers import policy, profile
from umbra.policy.budgets import BudgetBook, Metric, budgets_for
from umbra.policy.compose import EffectivePolicy
from umbra.policy.diff import diff_policy_sets
from umbra.policy.errors import PolicyError
from umbra.policy.loader import load_policy_dir
from umbra.policy.runner import run_suites

EGRESS = [
    {"id": "api", "allow": {"hosts": ["api.github.com"]}},
    {"id": "llm", "allow": {"hosts": ["api.anthropic.com"]}},
]
BUDGETS = [
    {"id": "api-rate", "per": "cvm", "hosts": ["*.github.com"], "requests_per_minute": 3},
    {"id": "tokens", "per": "owner", "rules": ["llm"], "tokens_per_month": 1000, "bytes_per_day": 5000},
]  # fmt: skip
T0 = datetime(2026, 12, 6, 5, 0, 10, tzinfo=UTC).timestamp()
ALICE = {"cvm": "cvm-1", "owner": "alice"}


def effective() -> EffectivePolicy:
    return policy(profile("p", EGRESS, budgets=BUDGETS))


def test_budgets_cover_requests_by_host_pattern_or_allowing_rule() -> None:
    budgets = effective().budgets
    assert [b.id for b in budgets_for(budgets, "api.github.com", "p:api")] == ["p:api-rate"]
    assert [b.id for b in budgets_for(budgets, "api.anthropic.com", "p:llm")] == ["p:tokens"]
    assert budgets_for(budgets, "github.com", "p:api") == []  # '*.' means strict subdomains


def test_requests_per_minute_are_reached_and_reset_by_the_next_minute() -> None:
    book = BudgetBook()
    budgets = budgets_for(effective().budgets, "api.github.com", "p:api")
    for _ in range(3):
        assert book.exhausted(budgets, ALICE, T0) is None
        book.charge(budgets, ALICE, Metric.REQUESTS, 1, T0)
    reached = book.exhausted(budgets, ALICE, T0 + 30)
    assert reached is not None and reached[1] is Metric.REQUESTS and reached[2] == 3
    # another CVM has its own counter; the next minute starts from zero
    assert book.exhausted(budgets, {"cvm": "cvm-2", "owner": "alice"}, T0) is None
    assert book.exhausted(budgets, ALICE, T0 + 60) is None


def test_tokens_per_month_are_per_owner_across_cvms() -> None:
    book = BudgetBook()
    budgets = budgets_for(effective().budgets, "api.anthropic.com", "p:llm")
    book.charge(budgets, ALICE, Metric.TOKENS, 999, T0)
    assert book.exhausted(budgets, {"cvm": "cvm-9", "owner": "alice"}, T0) is None
    book.charge(budgets, {"cvm": "cvm-9", "owner": "alice"}, Metric.TOKENS, 1, T0)
    assert book.exhausted(budgets, ALICE, T0)[1] is Metric.TOKENS  # type: ignore[index]
    assert book.exhausted(budgets, {"cvm": "cvm-1", "owner": "bob"}, T0) is None
    next_month = datetime(2027, 1, 1, tzinfo=UTC).timestamp()
    assert book.exhausted(budgets, ALICE, next_month) is None


def test_counters_survive_a_save_and_load_and_old_windows_are_dropped() -> None:
    book = BudgetBook()
    budgets = budgets_for(effective().budgets, "api.anthropic.com", "p:llm")
    book.charge(budgets, ALICE, Metric.BYTES, 5000, T0)
    loaded = BudgetBook.from_json(book.to_json(T0), T0 + 5)
    assert loaded.exhausted(budgets, ALICE, T0 + 5) is not None
    assert BudgetBook.from_json(book.to_json(T0), T0 + 86_400).counters == {}
    for junk in (b"", b"{", b'{"version": 2}', b'{"version": 1, "counters": [["a", 1]]}',
                 b'{"version": 1, "counters": [["a", "b", "bogus", "w", 5], ["a", "b", "bytes", "w", -1]]}'):  # fmt: skip
        assert BudgetBook.from_json(junk, T0).counters == {}


HEADER = "apiVersion: umbra/v1\nkind: Profile\nname: p\negress:\n  - {id: api, allow: {hosts: [x.com]}}\nbudgets:\n"


@pytest.mark.parametrize(
    ("entry", "field", "fragment"),
    [
        ("{id: b, per: cvm, requests_per_minute: 5}", "budgets[0]", "exactly one of 'hosts' or 'rules'"),
        ("{id: b, per: cvm, hosts: [x.com]}", "budgets[0]", "at least one of"),
        ("{id: b, per: team, hosts: [x.com], requests_per_minute: 5}", "budgets[0].per", ""),
        ("{id: b, per: cvm, hosts: [x.com], requests_per_minute: 0}", "budgets[0].requests_per_minute", ""),
        ("{id: b, per: cvm, hosts: [x.com], bytes_per_day: '5'}", "budgets[0].bytes_per_day", ""),
        ("{id: b, per: cvm, rules: [nope], requests_per_minute: 5}", "budgets[0].rules", "not an allow rule"),
        ("{id: api, per: cvm, hosts: [x.com], requests_per_minute: 5}", "budgets[0].id", "duplicate rule id"),
    ],
)  # fmt: skip
def test_budget_errors_name_file_line_and_field(
    tmp_path: Path, entry: str, field: str, fragment: str
) -> None:
    (tmp_path / "p.yaml").write_text(HEADER + f"  - {entry}\n")
    with pytest.raises(PolicyError) as excinfo:
        load_policy_dir(tmp_path)
    issue = excinfo.value.issues[0]
    assert (Path(issue.file).name, issue.line) == ("p.yaml", 7)
    assert issue.field == field and fragment in issue.message


PROFILE = HEADER + "  - {id: rate, per: cvm, hosts: [x.com], requests_per_minute: 60}\n"
SUITE = """apiVersion: umbra/v1
kind: PolicyTest
name: t
profiles: [p]
cases:
  - {request: GET https://x.com/, expect: allow, budgets: [p:rate]}
  - {request: GET https://y.com/, expect: deny, budgets: []}
"""


def test_policy_test_cases_name_the_budgets_that_cover_a_request(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(PROFILE)
    (tmp_path / "t.yaml").write_text(SUITE)
    assert [r.problems for r in run_suites(load_policy_dir(tmp_path))] == [(), ()]
    (tmp_path / "t.yaml").write_text(SUITE.replace("budgets: [p:rate]", "budgets: []"))
    [first, _] = run_suites(load_policy_dir(tmp_path))
    assert "expected budgets [], got ['p:rate']" in first.problems[0]


def _dir(tmp_path: Path, name: str, text: str) -> Path:
    (tmp_path / name).mkdir()
    (tmp_path / name / "p.yaml").write_text(text)
    return tmp_path / name


@pytest.mark.parametrize(
    ("before", "after", "widens"),
    [
        (PROFILE, HEADER.removesuffix("budgets:\n"), True),  # a budget removed
        (PROFILE, PROFILE.replace("60", "600"), True),  # raised
        (HEADER.removesuffix("budgets:\n"), PROFILE, False),  # added
    ],
)
def test_diff_widens_when_a_budget_is_removed_or_changed(
    tmp_path: Path, before: str, after: str, widens: bool
) -> None:
    a = load_policy_dir(_dir(tmp_path, "a", before))
    b = load_policy_dir(_dir(tmp_path, "b", after))
    assert diff_policy_sets(a, b).widens is widens


def test_a_profile_without_budgets_hashes_as_before() -> None:
    assert "budgets" not in profile("plain", EGRESS).model_dump(mode="json")
