"""Runs policy test suites against the profiles loaded beside them."""

from __future__ import annotations

from umbra.policy.body import decide_body
from umbra.policy.budgets import budgets_for
from umbra.policy.fields import BodyRequest
from umbra.policy.loader import LoadedSuite, PolicySet
from umbra.policy.matcher import Decision, decide_push
from umbra.policy.suite import Case, CaseResult, HttpProbe


def run_suites(policy_set: PolicySet) -> list[CaseResult]:
    """Evaluate every case; a suite whose profiles do not compose raises PolicyError."""
    results: list[CaseResult] = []
    for loaded in policy_set.suites:
        policy = policy_set.compose(loaded.suite.profiles, file=loaded.file, line=None)
        for index, case in enumerate(loaded.suite.cases):
            probe = case.probe()
            if isinstance(probe, HttpProbe):
                decision = policy.decide(
                    probe.method, probe.scheme, probe.host, probe.port, probe.path
                )
                if case.push is not None:
                    decision = decide_push(decision, case.push)
                body = case.body_request(probe)
                if decision.field_rules:
                    # a rule reading the body decides on the body given (none: an empty one)
                    empty = BodyRequest((), b"", probe.path.partition("?")[2], probe.method)
                    decision = decide_body(decision, body or empty)
                injected = sorted(
                    placement
                    for rule in policy.applicable_injections(probe.host, probe.port, decision)
                    for placement in rule.placements
                )
                covering = [
                    budget.id
                    for budget in budgets_for(policy.budgets, decision.host or "", decision.rule_id)
                ]
            else:
                decision = policy.decide_tunnel(probe.host, probe.port)
                injected, covering = [], []
            results.append(_judge(loaded, index, case, str(probe), decision, injected, covering))
    return results


def _judge(
    loaded: LoadedSuite,
    index: int,
    case: Case,
    probe: str,
    decision: Decision,
    injected: list[str],
    covering: list[str],
) -> CaseResult:
    problems: list[str] = []
    if decision.verdict != case.expect:
        problems.append(f"expected {case.expect}, got {decision.verdict} ({decision.reason})")
    if case.rule is not None and decision.rule_id != case.rule:
        problems.append(f"expected rule {case.rule}, got {decision.rule_id or 'none'}")
    if case.reason is not None and decision.reason != case.reason:
        problems.append(f"expected reason {case.reason}, got {decision.reason}")
    if case.inject is not None:
        expected = sorted(map(_placement_key, case.inject))
        if expected != sorted(map(_placement_key, injected)):
            problems.append(f"expected injected placements {case.inject}, got {injected}")
    if case.budgets is not None and sorted(case.budgets) != sorted(covering):
        problems.append(f"expected budgets {sorted(case.budgets)}, got {sorted(covering)}")
    return CaseResult(
        file=loaded.file,
        line=loaded.case_lines[index],
        suite=loaded.suite.name,
        case=case.name or probe,
        passed=not problems,
        expected=case.expect,
        actual=decision,
        problems=tuple(problems),
    )


def _placement_key(placement: str) -> str:
    # Header names compare case-insensitively, query parameter names (`?name`) exactly.
    return placement if placement.startswith("?") else placement.lower()
