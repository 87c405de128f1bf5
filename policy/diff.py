"""What two revisions of the policy directory allow or deny differently, for reviewers.

Each rule is expanded into atomic grants (action, host, endpoint, method, path pattern); the diff is
the set difference of grants, so reordering, splitting or renaming rules shows as no change, while
any widening or narrowing shows as exactly the grants it adds or removes. Test cases from both
revisions are then replayed against both policies to show concrete requests whose decision changes.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from umbra.contracts.canonical import canonical_json
from umbra.policy.compiled import CompiledProfile
from umbra.policy.errors import PolicyError
from umbra.policy.loader import PolicySet, load_policy_dir
from umbra.policy.model import FieldConstraint
from umbra.policy.suite import HttpProbe, TunnelProbe

Grant = tuple[str, ...]


@dataclass(frozen=True)
class GrantChange:
    kind: str  # "http:allow", "http:deny", "tunnel", "inject", "scan" or "budget"
    grant: Grant
    rule_id: str

    def describe(self) -> str:
        return " ".join(self.grant)


@dataclass(frozen=True)
class DecisionChange:
    probe: str
    profiles: tuple[str, ...]
    before: str
    after: str


@dataclass
class PolicyDiff:
    added: list[GrantChange] = field(default_factory=list)
    removed: list[GrantChange] = field(default_factory=list)
    profiles_added: list[str] = field(default_factory=list)
    profiles_removed: list[str] = field(default_factory=list)
    decisions: list[DecisionChange] = field(default_factory=list)

    @property
    def widens(self) -> bool:
        """True when B can reach something A could not (or loses a deny, scan rule or the like)."""
        widening = {"http:allow", "tunnel", "inject"}
        # a budget removed or changed (its old limit removed) widens
        narrowing_lost = {"http:deny", "scan", "budget"}
        # a limit (push refs, body, MCP tools) put on a grant that had none narrows it
        unlimited_removed = {change.grant for change in self.removed if change.kind == "http:allow"}
        return any(
            change.kind in widening and change.grant[:5] not in unlimited_removed
            for change in self.added
        ) or any(change.kind in narrowing_lost for change in self.removed)

    @property
    def empty(self) -> bool:
        return not (
            self.added
            or self.removed
            or self.profiles_added
            or self.profiles_removed
            or self.decisions
        )


def grants(profile: CompiledProfile) -> Iterator[GrantChange]:
    for rule in profile.rules:
        for host in rule.hosts:
            for endpoint in rule.endpoints:
                methods: list[str] = list(rule.methods) if rule.methods else ["*"]
                for method in methods:
                    for path in rule.paths or ["/**"]:
                        grant: tuple[str, ...] = (rule.action, host, endpoint, method, path)
                        if rule.push_refs is not None:
                            # dropping a push limit widens: the grant without it is new
                            grant += ("push", ",".join(rule.push_refs))
                        # dropping or changing a body limit shows as a grant without it; an MCP
                        # rule grants one tool each (adding a tool widens, removing one does not)
                        if rule.body is not None:
                            grant += ("body", _limit_text(rule.body))
                        if rule.mcp is None:
                            yield GrantChange(f"http:{rule.action}", grant, rule.id)
                            continue
                        for tool in rule.mcp.tools:
                            tool_grant = (*grant, "mcp-tool", tool.name)
                            if tool.arguments is not None:
                                tool_grant += ("arguments", _limit_text(tool.arguments))
                            yield GrantChange(f"http:{rule.action}", tool_grant, rule.id)
    for tunnel in profile.tunnels:
        for host in tunnel.hosts:
            for port in tunnel.ports:
                yield GrantChange("tunnel", ("tunnel", f"{host}:{port}"), tunnel.id)
    for inject in profile.inject:
        for host in inject.hosts:
            for port in inject.ports:
                # one grant per placement and path, as allow rules expand per path
                for placement in inject.placements:
                    for path in inject.paths or ["/**"]:
                        grant = ("inject", placement, "for", f"{host}:{port}", path)
                        grant += ("from", inject.secret)
                        if inject.user_secret is not None:
                            grant += ("user", inject.user_secret)
                        yield GrantChange("inject", grant, inject.id)
    for scan in profile.scan:
        yield GrantChange("scan", ("scan", scan.id, scan.regex), scan.id)
    for budget in profile.budgets:
        scope = ",".join(budget.hosts or budget.rules or [])
        for limit in ("requests_per_minute", "bytes_per_day", "tokens_per_month"):
            value = getattr(budget, limit)
            if value is not None:
                grant = ("budget", budget.id, f"per {budget.per}", scope, limit, str(value))
                yield GrantChange("budget", grant, budget.id)


def _limit_text(constraints: list[FieldConstraint]) -> str:
    return canonical_json([item.model_dump(mode="json") for item in constraints]).decode()


def diff_policy_sets(before: PolicySet, after: PolicySet) -> PolicyDiff:
    result = PolicyDiff(
        profiles_added=sorted(set(after.profiles) - set(before.profiles)),
        profiles_removed=sorted(set(before.profiles) - set(after.profiles)),
    )
    old = {
        (change.kind, change.grant): change
        for p in before.profiles.values()
        for change in grants(p.compiled)
    }
    new = {
        (change.kind, change.grant): change
        for p in after.profiles.values()
        for change in grants(p.compiled)
    }
    result.added = [new[key] for key in sorted(new.keys() - old.keys())]
    result.removed = [old[key] for key in sorted(old.keys() - new.keys())]
    result.decisions = _decision_changes(before, after)
    return result


def _decision_changes(before: PolicySet, after: PolicySet) -> list[DecisionChange]:
    seen: set[tuple[str, tuple[str, ...]]] = set()
    changes: list[DecisionChange] = []
    for suite in [*before.suites, *after.suites]:
        profiles = tuple(sorted(suite.suite.profiles))
        for case in suite.suite.cases:
            probe = case.probe()
            key = (str(probe), profiles)
            if key in seen:
                continue
            seen.add(key)
            outcomes = [_outcome(policy_set, profiles, probe) for policy_set in (before, after)]
            if outcomes[0] != outcomes[1]:
                changes.append(DecisionChange(str(probe), profiles, outcomes[0], outcomes[1]))
    return changes


def _outcome(
    policy_set: PolicySet, profiles: tuple[str, ...], probe: HttpProbe | TunnelProbe
) -> str:
    try:
        policy = policy_set.compose(profiles)
    except PolicyError as exc:
        return f"does not compose ({exc.issues[0].message})"
    if isinstance(probe, HttpProbe):
        decision = policy.decide(probe.method, probe.scheme, probe.host, probe.port, probe.path)
    else:
        decision = policy.decide_tunnel(probe.host, probe.port)
    return f"{decision.verdict} ({decision.rule_id or decision.reason})"


def load_at_revision(repo: Path, revision: str, subdir: str) -> PolicySet:
    """Load `subdir` of `repo` as it was at `revision`; a revision without it is an empty set."""
    prefix = subdir.strip("/")
    listing = _git(repo, "ls-tree", "--name-only", revision, "--", prefix)
    display = f"{revision}:{prefix}"
    if not listing.strip():
        return PolicySet(root=Path(display))
    archive = _git_bytes(repo, "archive", "--format=tar", revision, "--", prefix)
    with tempfile.TemporaryDirectory(prefix="umbra-policy-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        return load_policy_dir(Path(tmp) / prefix, display_root=display)


def _git(repo: Path, *args: str) -> str:
    return _git_bytes(repo, *args).decode()


def _git_bytes(repo: Path, *args: str) -> bytes:
    try:
        completed = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, check=False
        )
    except FileNotFoundError:
        raise PolicyError.single(str(repo), None, "", "git is not installed") from None
    if completed.returncode != 0:
        message = completed.stderr.decode(errors="replace").strip().splitlines()
        raise PolicyError.single(
            str(repo),
            None,
            "",
            f"git {args[0]} failed: {message[-1] if message else completed.returncode}",
        )
    return completed.stdout
