"""A profile's sandbox environment (`sandbox_env`): non-secret variables and placeholders a
profile puts into every sandbox it is attached to (`CLAUDE_CODE_OAUTH_TOKEN=umbra-placeholder:...`,
`AWS_ACCESS_KEY_ID=umbra-placeholder`, `AWS_REGION=us-east-1`). A value that looks like a real
credential by the scanner's rules (the built-in ones and the profile's own `scan` rules) is
refused: a reviewer must never merge a secret into the policy repository by way of an
environment variable. Which names and values may be set at all is the contract's rule
(contracts/sandbox_env.py), which the forwarder applies again."""

from __future__ import annotations

import re
from collections.abc import Iterable

from umbra.policy.builtin_scan import BUILTIN_SCAN_RULES


def _compiled(items: Iterable[tuple[str, str]]) -> list[tuple[str, re.Pattern[str]]]:
    rules = []
    for rule_id, pattern in items:
        try:
            rules.append((rule_id, re.compile(pattern)))
        except re.error:
            continue  # a profile's own regex is checked (and reported) where it is declared
    return rules


_BUILTIN = _compiled(BUILTIN_SCAN_RULES.items())


def credential_rule(value: str, scan: Iterable[tuple[str, str]] = ()) -> str | None:
    """The id of the first scan rule (built-in, then `scan`) `value` matches, or None."""
    for rule_id, pattern in _BUILTIN + _compiled(scan):
        if pattern.search(value):
            return rule_id
    return None
