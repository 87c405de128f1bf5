"""Composition of compiled profiles into the one effective policy a sandbox runs under.

Allows are the union of every profile's allows; a matching deny from any profile wins; the built-in
scan rules are always present; two injections of the same header for the same host are an error, as
are two rules with one id. No profile at all yields a policy that denies everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from umbra.contracts.canonical import content_hash
from umbra.policy.builtin_scan import BUILTIN_SCAN_RULES
from umbra.policy.compiled import CompiledBudget, CompiledInject, CompiledProfile, CompiledScan
from umbra.policy.matcher import Decision, Matcher, Reason, Verdict, host_keys, path_within
from umbra.policy.model import API_VERSION
from umbra.policy.normalize import NormalizationError, normalize_host

BUILTIN_SCAN = tuple(
    CompiledScan(id=rule_id, regex=regex) for rule_id, regex in BUILTIN_SCAN_RULES.items()
)


@dataclass(frozen=True)
class Conflict:
    """A composition error, attributed to the rule that caused it."""

    rule_id: str
    message: str
    field: str = ""  # the rule's field at fault, when there is one


class CompositionError(Exception):
    def __init__(self, conflicts: list[Conflict]) -> None:
        self.conflicts = conflicts
        super().__init__("; ".join(f"{c.rule_id}: {c.message}" for c in conflicts))


class EffectivePolicy:
    """The composed, indexed policy; immutable once built."""

    def __init__(self, profiles: Sequence[CompiledProfile]) -> None:
        ordered = sorted(profiles, key=lambda profile: profile.name)
        self.profiles: tuple[CompiledProfile, ...] = tuple(ordered)
        _check_conflicts(self.profiles)
        self.rules = tuple(rule for profile in ordered for rule in profile.rules)
        self.tunnels = tuple(tunnel for profile in ordered for tunnel in profile.tunnels)
        self.scan_rules: tuple[CompiledScan, ...] = BUILTIN_SCAN + tuple(
            rule for profile in ordered for rule in profile.scan
        )
        self.injections: tuple[CompiledInject, ...] = tuple(
            rule for profile in ordered for rule in profile.inject
        )
        # The sandbox's environment from every profile (equal values only: checked above).
        self.sandbox_env: dict[str, str] = dict(
            sorted(item for profile in ordered for item in profile.sandbox_env.items())
        )
        self._matcher = Matcher(self.rules, self.tunnels)
        self.budgets: tuple[CompiledBudget, ...] = tuple(
            budget for profile in ordered for budget in profile.budgets
        )
        self._inject_by_target: dict[tuple[str, int], tuple[CompiledInject, ...]] = {}
        for rule in self.injections:
            for host in rule.hosts:
                for port in rule.ports:
                    key = (host, port)
                    self._inject_by_target[key] = (*self._inject_by_target.get(key, ()), rule)
        # An injection applies only to HTTPS requests its own profile allows on its host and port:
        # one whose profile allows nothing there would never apply.
        https_allowed = {
            profile.name: {
                (host, int(endpoint.split(":")[1]))
                for rule in profile.rules
                if rule.action == Verdict.ALLOW
                for host in rule.hosts
                for endpoint in rule.endpoints
                if endpoint.startswith("https:")
            }
            for profile in ordered
        }
        unreachable = [
            Conflict(
                rule.id,
                f"injects for {host!r} on port {port}, which no HTTPS allow rule of its profile reaches",
            )
            for rule in self.injections
            for host in rule.hosts
            for port in rule.ports
            if not any(
                (key, port) in https_allowed[rule.id.split(":", 1)[0]] for key in host_keys(host)
            )
        ]
        if unreachable:
            raise CompositionError(unreachable)

    @property
    def profile_names(self) -> tuple[str, ...]:
        return tuple(profile.name for profile in self.profiles)

    @property
    def is_empty(self) -> bool:
        return not self.profiles

    def document(self) -> dict[str, Any]:
        """The canonical description of this policy (what its hash covers)."""
        return {
            "apiVersion": API_VERSION,
            "kind": "EffectivePolicy",
            "profiles": [profile.model_dump(mode="json") for profile in self.profiles],
            "builtinScan": [rule.model_dump(mode="json") for rule in BUILTIN_SCAN],
        }

    @cached_property
    def hash(self) -> str:
        return content_hash(self.document())

    def decide(self, method: str, scheme: str, host: str, port: int, path: str) -> Decision:
        if self.is_empty:
            return Decision(Verdict.DENY, Reason.NO_POLICY, detail="no profile is attached")
        return self._matcher.decide(method, scheme, host, port, path)

    def decide_tunnel(self, host: str, port: int) -> Decision:
        if self.is_empty:
            return Decision(Verdict.DENY, Reason.NO_POLICY, detail="no profile is attached")
        return self._matcher.decide_tunnel(host, port)

    def may_connect(self, host: str, port: int) -> bool:
        """False when no rule could admit anything to host:port; see `Matcher.may_connect`."""
        return not self.is_empty and self._matcher.may_connect(host, port)

    def applicable_injections(
        self, host: str, port: int, decision: Decision
    ) -> tuple[CompiledInject, ...]:
        """The injections a request carries: bound to its host and port (and path, when the
        injection names paths), of a profile that allows it.

        A profile's credential goes only with the requests that profile's reviewer granted; a
        request another profile allows carries none of it (and is not denied for its lack).
        """
        if not decision.allowed:
            return ()
        return tuple(
            rule
            for rule in self.injections_for(host, port)
            if rule.id.split(":", 1)[0] in decision.allowed_by
            and (rule.paths is None or path_within(rule.paths, decision.path or ""))
        )

    def injections_for(self, host: str, port: int) -> tuple[CompiledInject, ...]:
        """Injections bound to this exact host and port; empty for a host that does not
        normalize. Injections are made over HTTPS only (the proxy refuses the rest)."""
        try:
            return self._inject_by_target.get((normalize_host(host), port), ())
        except NormalizationError:
            return ()


def _check_conflicts(profiles: Sequence[CompiledProfile]) -> None:
    conflicts: list[Conflict] = []
    env: dict[str, tuple[str, str]] = {}  # variable -> (value, profile that set it)
    for profile in profiles:
        for name, value in profile.sandbox_env.items():
            if name in env and env[name][0] != value:
                conflicts.append(
                    Conflict(
                        f"{profile.name}:sandbox_env",
                        f"sets {name} to another value than profile {env[name][1]} does",
                        "sandbox_env",
                    )
                )
            env.setdefault(name, (value, profile.name))
    seen_names: set[str] = set()
    seen_ids: set[str] = {rule.id for rule in BUILTIN_SCAN}
    injected: dict[tuple[str, str, int], str] = {}
    for profile in profiles:
        if profile.name in seen_names:
            conflicts.append(Conflict(f"{profile.name}:*", "profile appears twice"))
            continue
        seen_names.add(profile.name)
        ids = [
            item.id
            for items in (profile.rules, profile.tunnels, profile.scan, profile.inject)
            for item in items
        ]
        for rule_id in ids:
            if rule_id in seen_ids:
                conflicts.append(Conflict(rule_id, "rule id is used twice"))
            seen_ids.add(rule_id)
        for rule in profile.inject:
            # Two placements of one header or query parameter on one host and port conflict
            # whatever their paths: which credential a request carries must not depend on which
            # of two overlapping path lists a reviewer meant.
            targets = [("headers", "header", h.name.lower(), h.name) for h in rule.headers]
            if rule.query is not None:
                targets.append(("query", "query parameter", rule.query, rule.query))
            if rule.sigv4 is not None:  # the AWS signature is the request's Authorization
                targets.append(("headers", "header", "authorization", "Authorization (sigv4)"))
            for host in rule.hosts:
                for port in rule.ports:
                    for field_name, kind, key_name, shown in targets:
                        key = (f"{field_name}:{key_name}", host, port)
                        if key in injected:
                            conflicts.append(
                                Conflict(
                                    rule.id,
                                    f"injects {kind} {shown!r} for {host}:{port}, as "
                                    f"{injected[key]} already does",
                                    field_name,
                                )
                            )
                        injected.setdefault(key, rule.id)
    if conflicts:
        raise CompositionError(conflicts)


def deny_all() -> EffectivePolicy:
    """The policy of a sandbox with nothing attached (or nothing trusted yet)."""
    return EffectivePolicy([])
