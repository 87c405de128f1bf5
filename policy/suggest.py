"""Drafting a profile from observed denials (`umbra policy suggest`), for a human to review.

Only requests no rule allowed (`no_matching_rule`, `no_policy`) are drafted; denials a rule cannot
fix by allowing (a deny rule, a detected secret, a budget, a body constraint...) are listed as
comments, never turned into grants. The draft is narrowest first: one rule per exact host, port,
scheme and method; one path gives that exact path, several give their longest common segment
prefix with `/**` (a lone root gives `/**` for the whole host, said so in the comment). With the
profile comes a `PolicyTest` suite holding every drafted request as an expected allow, so the draft
passes `umbra policy test` as written and keeps passing only while it still grants them.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import yaml

from umbra.policy.model import METHODS, SCHEME_DEFAULT_PORTS, Profile
from umbra.policy.normalize import NormalizationError, normalize_host, normalize_path
from umbra.policy.suite import Suite

FIXABLE = frozenset({"no_matching_rule", "no_policy"})
MAX_RULES = 200
_SLUG = re.compile(r"[^a-z0-9]+")


@dataclass(frozen=True)
class Denial:
    method: str
    scheme: str
    host: str
    port: int
    path: str
    reason: str


@dataclass(frozen=True)
class Draft:
    profile: str  # YAML text
    suite: str  # YAML text
    rules: int
    skipped: dict[str, int]  # reason -> count of denials not drafted


def _slug(text: str) -> str:
    return _SLUG.sub("-", text.lower()).strip("-")[:40].strip("-") or "x"


def _prefix(paths: Sequence[str]) -> str:
    if len(set(paths)) == 1:
        return paths[0]
    split = [path.strip("/").split("/") if path != "/" else [] for path in paths]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return "/" + "/".join([*common, "**"])


def draft(name: str, denials: Iterable[Denial], source: str) -> Draft:
    """The profile `name` and its suite, drafted from `denials` (described by `source` in the
    comments: which CVM, which period)."""
    groups: dict[tuple[str, str, int, str], list[str]] = defaultdict(list)
    skipped: dict[str, int] = defaultdict(int)
    for denial in denials:
        if denial.reason not in FIXABLE:
            skipped[denial.reason] += 1
            continue
        try:
            host = normalize_host(denial.host)
            path = normalize_path(denial.path.partition("?")[0] or "/")
        except NormalizationError:
            skipped["unreadable_request"] += 1
            continue
        if denial.method not in METHODS or denial.scheme not in SCHEME_DEFAULT_PORTS:
            skipped["unreadable_request"] += 1
            continue
        groups[(host, denial.scheme, denial.port, denial.method)].append(path)
    egress: list[dict[str, object]] = []
    cases: list[dict[str, object]] = []
    used: set[str] = set()
    for (host, scheme, port, method), paths in sorted(groups.items())[:MAX_RULES]:
        pattern = _prefix(sorted(set(paths)))
        base = f"{_slug(host)}-{method.lower()}"
        rule_id, n = base, 2
        while rule_id in used:
            rule_id, n = f"{base}-{n}", n + 1
        used.add(rule_id)
        match: dict[str, object] = {"hosts": [host], "methods": [method], "paths": [pattern]}
        if scheme != "https":
            match["schemes"] = [scheme]
        if port != SCHEME_DEFAULT_PORTS[scheme]:
            match["ports"] = [port]
        distinct = sorted(set(paths))
        why = f"{len(paths)} denial(s), {len(distinct)} path(s)"
        if pattern == "/**":
            why += "; no common path prefix: this grants the whole host, narrow it if you can"
        egress.append({"id": rule_id, "comment": why, "allow": match})
        port_text = "" if port == SCHEME_DEFAULT_PORTS[scheme] else f":{port}"
        for path in distinct[:5]:
            cases.append(
                {
                    "request": f"{method} {scheme}://{host}{port_text}{path}",
                    "expect": "allow",
                    "rule": f"{name}:{rule_id}",
                }
            )
    description = (
        f"Drafted by umbra policy suggest from {source}. Review every rule before merging."
    )
    document = {
        "apiVersion": "umbra/v1",
        "kind": "Profile",
        "name": name,
        "description": description,
        "egress": egress,
    }
    Profile.model_validate(document)  # a draft that would not load is a bug here, not a file
    header = [
        f"# DRAFT from {source}: nothing is allowed until this is reviewed, merged, signed",
        "# and published (umbra policy build / publish). Narrowest first: exact host, method, path.",
    ]
    header += [
        f"# not drafted: {count} denial(s) for {reason} (a rule allowing more would not fix them)"
        for reason, count in sorted(skipped.items())
    ]
    profile_text = "\n".join(header) + "\n" + yaml.safe_dump(document, sort_keys=False, width=100)
    suite: dict[str, object] = {
        "apiVersion": "umbra/v1",
        "kind": "PolicyTest",
        "name": name,
        "profiles": [name],
        "cases": cases,
    }
    suite_text = ""
    if cases:
        Suite.model_validate(suite)
        suite_text = "# DRAFT: the requests the draft was made from\n" + yaml.safe_dump(
            suite, sort_keys=False, width=100
        )
    return Draft(profile_text, suite_text, len(egress), dict(skipped))
