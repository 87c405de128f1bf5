"""The decision for a request body: `decide_body` turns an allow decision whose rules read the
body (`body` field rules, `mcp` tool rules) into the decision for that body. The proxy and `policy
test` both call it."""

from __future__ import annotations

from umbra.policy.compiled import CompiledHttpRule
from umbra.policy.fields import BodyError, BodyRequest, parse_body, violations
from umbra.policy.matcher import Decision, Reason, Verdict
from umbra.policy.mcp import mcp_violation

__all__ = ["BodyRequest", "decide_body", "field_rules"]


def field_rules(decision: Decision) -> tuple[CompiledHttpRule, ...] | None:
    return decision.field_rules if decision.allowed else None


def decide_body(decision: Decision, request: BodyRequest) -> Decision:
    """The decision for a request whose allow rules read the body (`Decision.field_rules`):
    allowed when one of those rules admits it (allows are a union), else denied with the reason
    of the first (`body_field_denied`, `mcp_*`, `body_unreadable`, `body_limit`)."""
    rules = field_rules(decision)
    if not rules:
        return decision
    if request.method != "POST" and not request.body and all(r.mcp for r in rules):
        # streamable HTTP: a GET opens the server's event stream, a DELETE ends the session
        return decision
    try:
        document = parse_body(request)
    except BodyError as exc:
        return _denied(decision, rules[0].id, exc.reason, str(exc))
    first: tuple[str, Reason, str] | None = None
    for rule in rules:
        if rule.body is not None:
            problems = violations(document, rule.body)
            outcome = (Reason.BODY_FIELD_DENIED, problems[0]) if problems else None
        else:
            assert rule.mcp is not None
            outcome = mcp_violation(document, rule.mcp)
        if outcome is None:
            return Decision(
                Verdict.ALLOW,
                decision.reason,
                rule.id,
                decision.host,
                decision.path,
                push_refs=decision.push_refs,
                allowed_by=decision.allowed_by,
                field_rules=decision.field_rules,
            )
        if first is None:
            first = (rule.id, *outcome)
    assert first is not None
    return _denied(decision, *first)


def _denied(decision: Decision, rule_id: str, reason: Reason, detail: str) -> Decision:
    return Decision(
        Verdict.DENY,
        reason,
        rule_id,
        decision.host,
        decision.path,
        detail,
        field_rules=decision.field_rules,
    )
