"""The body of a denial: one sentence an agent (or a human reading its log) can act on.

The first line says what was refused (method, host, path), why (reason and rule), which profiles
are attached, and what a human would change (the profile to attach, the rule to propose, the secret
to set). Package managers show a body badly or not at all, so the line comes first and stands
alone; clients that ask for JSON (npm, the model APIs' SDKs) get the same sentence as `error` and
`message` (npm prints `error`), with the fields beside it. The caller redacts the text: it never
carries a query, a header or a body, and not the path of a request the scanner flagged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from umbra.policy import EffectivePolicy
from umbra.proxy.addons.reasons import Reason

MAX_PATH = 120

# Reasons that come from what the request carried: its path is not repeated back.
_CONTENT_REASONS = frozenset(
    {Reason.SECRET_DETECTED, Reason.PLACEHOLDER_UNBOUND, Reason.SCAN_LIMIT}
)


@dataclass(frozen=True, slots=True)
class Refused:
    method: str
    scheme: str
    host: str
    port: int
    path: str  # without the query
    reason: Reason
    detail: str
    rule_id: str | None
    profiles: tuple[str, ...]  # attached to the CVM
    candidates: tuple[str, ...] = ()  # profiles not attached that would allow the request
    missing_secret: str | None = None  # team/NAME or personal/NAME


def _why(r: Refused) -> str:
    rule = f" {r.rule_id}" if r.rule_id else ""
    match r.reason:
        case Reason.NO_MATCHING_RULE:
            return "no rule of the attached profiles allows it"
        case Reason.RULE_DENY:
            return f"deny rule{rule} matches it, and a deny wins over every allow"
        case Reason.NO_POLICY:
            return "no profile is attached to this CVM"
        case Reason.SECRET_DETECTED:
            return f"it carries what looks like a credential ({r.detail or 'scan rule'})"
        case Reason.PLACEHOLDER_UNBOUND:
            return "it carries a secret placeholder that no injection binds to this host"
        case Reason.SECRET_UNAVAILABLE:
            return f"injection{rule} needs secret {r.missing_secret}, which is not set"
        case _:
            return r.detail or str(r.reason)


def _change(r: Refused) -> str:
    match r.reason:
        case Reason.NO_MATCHING_RULE | Reason.NO_POLICY if r.candidates:
            names = ", ".join(r.candidates[:3])
            return f"ask an admin to attach profile {names}"
        case Reason.NO_MATCHING_RULE | Reason.NO_POLICY:
            return f"propose an allow rule for {r.method} {r.host} in a profile (policies/)"
        case Reason.RULE_DENY:
            return f"propose a change to rule {r.rule_id} (policies/), reviewed like any widening"
        case Reason.SECRET_DETECTED:
            return "remove the credential; the proxy injects the ones the policy binds"
        case Reason.PLACEHOLDER_UNBOUND:
            return "send it only to a host whose profile injects that secret"
        case Reason.SECRET_UNAVAILABLE:
            scope, _, name = (r.missing_secret or "team/?").partition("/")
            personal = " --personal" if scope == "personal" else ""
            return f"set it: umbra secret set {name}{personal} --host {r.host}"
        case Reason.BODY_FIELD_DENIED | Reason.MCP_TOOL_DENIED | Reason.MCP_METHOD_DENIED:
            return f"propose a change to rule {r.rule_id} (policies/), reviewed like any widening"
        case Reason.BODY_UNREADABLE | Reason.BODY_LIMIT | Reason.MCP_MALFORMED:
            return f"send one JSON document or form (see the reason) that rule {r.rule_id} can read"
        case Reason.BUDGET_EXCEEDED:
            return "wait for the budget's window to pass, or propose a larger budget (policies/)"
        case Reason.INVALID_PATH | Reason.INVALID_METHOD | Reason.INVALID_HOST:
            return "send it in a form with one reading (see the reason)"
        case _:
            return "see the reason; a human can read this request in `umbra logs`"


def sentence(r: Refused) -> str:
    port = "" if (r.scheme, r.port) in (("https", 443), ("http", 80)) else f":{r.port}"
    if r.reason in _CONTENT_REASONS:
        target = f"{r.method} {r.scheme}://{r.host}{port}"
    else:
        path = r.path if len(r.path) <= MAX_PATH else r.path[:MAX_PATH] + "..."
        target = f"{r.method} {r.scheme}://{r.host}{port}{path}"
    attached = ", ".join(r.profiles) if r.profiles else "none"
    return (
        f"umbra: denied ({r.reason}): {target}: {_why(r)}; attached profiles: {attached}; "
        f"to allow it, {_change(r)}."
    )


def render(r: Refused, wants_json: bool, clean: Callable[[str], str]) -> tuple[bytes, str]:
    """(body, content type). `clean` redacts secrets (the traffic log's redactor)."""
    text = clean(sentence(r).replace("\r", " ").replace("\n", " "))
    if not wants_json:
        lines = [text, f"reason: {r.reason}"]
        if r.rule_id:
            lines.append(f"rule: {r.rule_id}")
        if r.missing_secret:
            lines.append(f"missing secret: {r.missing_secret}")
        return ("\n".join(lines) + "\n").encode(), "text/plain; charset=utf-8"
    document = {
        "error": text,
        "message": text,
        "umbra": {
            "reason": str(r.reason),
            "rule_id": r.rule_id,
            "profiles": list(r.profiles),
            "candidates": list(r.candidates),
            "missing_secret": r.missing_secret,
        },
    }
    return json.dumps(document).encode() + b"\n", "application/json"


class Advisor:
    """Which profiles of the enforced source, not attached, would allow a refused request.

    Only asked on a denial; each profile is composed alone once per policy generation.
    """

    MAX_PROFILES = 64

    def __init__(self) -> None:
        self._generation = -1
        self._alone: dict[str, EffectivePolicy | None] = {}

    def candidates(
        self,
        generation: int,
        available: list[str],
        compose: Callable[[list[str]], EffectivePolicy],
        attached: tuple[str, ...],
        request: tuple[str, str, str, int, str],
    ) -> tuple[str, ...]:
        if generation != self._generation:
            self._generation, self._alone = generation, {}
        found = []
        for name in available[: self.MAX_PROFILES]:
            if name in attached:
                continue
            if name not in self._alone:
                try:
                    self._alone[name] = compose([name])
                except Exception:  # a profile that does not compose alone is never suggested
                    self._alone[name] = None
            policy = self._alone[name]
            if policy is not None and policy.decide(*request).allowed:
                found.append(name)
        return tuple(found)
