"""Constant-cost rule lookup: `decide(method, scheme, host, port, path)`.

Rules are indexed by host key (the exact name, each `*.suffix` of it, and `*`), and under each key by a
trie of path segments, so a decision touches only the rules that could match: at most one trie per
label of the host, and within it only the branches the path walks. The number of rules elsewhere in
the policy does not enter the cost.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from fnmatch import translate

from umbra.contracts.traffic import Decision as TrafficDecision
from umbra.policy.compiled import CompiledHttpRule, CompiledTunnel
from umbra.policy.model import ANY_HOST, METHODS
from umbra.policy.normalize import (
    NormalizationError,
    is_ip_literal,
    normalize_host,
    normalize_request_path,
)

_KNOWN_METHODS = frozenset(METHODS)

# A decision's allow/deny is the traffic record's own vocabulary (one enum, contracts/traffic.py).
Verdict = TrafficDecision


class Reason(StrEnum):
    """Why a decision came out as it did; stable strings for the traffic log."""

    RULE_ALLOW = "rule_allow"
    RULE_DENY = "rule_deny"
    NO_MATCHING_RULE = "no_matching_rule"
    NO_POLICY = "no_policy"
    INVALID_HOST = "invalid_host"
    INVALID_PATH = "invalid_path"
    INVALID_METHOD = "invalid_method"
    INVALID_SCHEME = "invalid_scheme"
    INVALID_PORT = "invalid_port"
    PUSH_REF_DENIED = "push_ref_denied"
    BODY_FIELD_DENIED = "body_field_denied"
    BODY_UNREADABLE = "body_unreadable"
    BODY_LIMIT = "body_limit"
    MCP_TOOL_DENIED = "mcp_tool_denied"
    MCP_METHOD_DENIED = "mcp_method_denied"
    MCP_MALFORMED = "mcp_malformed"


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    reason: Reason
    rule_id: str | None = None
    host: str | None = None
    path: str | None = None
    detail: str = ""
    # Refs a git push this allows may change (the union over every matching allow rule); None: any.
    push_refs: tuple[str, ...] | None = None
    # Every profile with an allow rule that matches (not only the reported one): an injection
    # applies to the requests its own profile allows (`EffectivePolicy.applicable_injections`).
    allowed_by: tuple[str, ...] = ()
    # The matching allow rules that read the body (`body`, `mcp`); None when a matching allow rule
    # does not (allows are a union: it admits any body). `umbra.policy.body.decide_body` reads it.
    field_rules: tuple[CompiledHttpRule, ...] | None = None

    @property
    def allowed(self) -> bool:
        return self.verdict is Verdict.ALLOW


@dataclass(frozen=True, slots=True)
class _Entry:
    order: int
    rule: CompiledHttpRule
    methods: frozenset[str] | None
    endpoints: frozenset[str]


@functools.lru_cache(maxsize=4096)
def _glob(segment: str) -> re.Pattern[str]:
    return re.compile(translate(segment))


@dataclass(slots=True)
class _PathTrie[T]:
    literal: dict[str, _PathTrie[T]] = field(default_factory=dict)
    globs: list[tuple[re.Pattern[str], _PathTrie[T]]] = field(default_factory=list)
    globstar: _PathTrie[T] | None = None
    entries: list[T] = field(default_factory=list)

    def insert(self, segments: list[str], entry: T) -> None:
        node = self
        for segment in segments:
            if segment == "**":
                node.globstar = node.globstar or _PathTrie[T]()
                node = node.globstar
            elif "*" in segment:
                pattern = _glob(segment)
                existing = next((child for p, child in node.globs if p is pattern), None)
                if existing is None:
                    existing = _PathTrie[T]()
                    node.globs.append((pattern, existing))
                node = existing
            else:
                node = node.literal.setdefault(segment, _PathTrie[T]())
        node.entries.append(entry)

    def match(self, segments: list[str]) -> Iterator[T]:
        # Depth-first walk; (node, position) pairs are visited once, which bounds the work of '**'
        # to nodes x segments however the patterns nest.
        seen: set[tuple[int, int]] = set()
        stack: list[tuple[_PathTrie[T], int]] = [(self, 0)]
        while stack:
            node, position = stack.pop()
            if (id(node), position) in seen:
                continue
            seen.add((id(node), position))
            if node.globstar is not None:
                for start in range(position, len(segments) + 1):
                    stack.append((node.globstar, start))
            if position == len(segments):
                yield from node.entries
                continue
            segment = segments[position]
            child = node.literal.get(segment)
            if child is not None:
                stack.append((child, position + 1))
            for pattern, glob_child in node.globs:
                if pattern.match(segment):
                    stack.append((glob_child, position + 1))


@functools.lru_cache(maxsize=1024)
def _patterns_trie(patterns: tuple[str, ...]) -> _PathTrie[bool]:
    trie = _PathTrie[bool]()
    for pattern in patterns:
        trie.insert(pattern[1:].split("/"), True)
    return trie


def path_within(patterns: Sequence[str], path: str) -> bool:
    """True when every reading of the request path (`normalize_request_path`) matches one of the
    path patterns: what is granted something (an injected credential) only on some paths must
    not get it through a reading the patterns did not cover. An unreadable path is within none."""
    try:
        request_path = normalize_request_path(path.split("?", 1)[0])
    except NormalizationError:
        return False
    trie = _patterns_trie(tuple(patterns))
    readings = [request_path.segments, request_path.literal_segments]
    return all(
        any(True for _ in trie.match(list(segments)))
        for segments in readings
        if segments is not None
    )


def host_keys(host: str) -> Iterator[str]:
    """The index keys under which rules for a normalized host can live, most specific first."""
    yield host
    if not is_ip_literal(host):
        labels = host.split(".")
        for index in range(1, len(labels)):
            yield "*." + ".".join(labels[index:])
    yield ANY_HOST


class Matcher:
    def __init__(
        self, rules: Sequence[CompiledHttpRule], tunnels: Iterable[CompiledTunnel]
    ) -> None:
        self._by_host: dict[str, _PathTrie[_Entry]] = {}
        for order, rule in enumerate(rules):
            entry = _Entry(
                order=order,
                rule=rule,
                methods=frozenset(rule.methods) if rule.methods is not None else None,
                endpoints=frozenset(rule.endpoints),
            )
            for host in rule.hosts:
                trie = self._by_host.setdefault(host, _PathTrie[_Entry]())
                for path in rule.paths or ["/**"]:
                    trie.insert(path[1:].split("/"), entry)
        # host key -> ports some allow rule grants there: lets a proxy refuse a CONNECT up front.
        self._allow_ports: dict[str, set[int]] = {}
        for rule in rules:
            if rule.action == Verdict.ALLOW:
                ports = {int(endpoint.split(":")[1]) for endpoint in rule.endpoints}
                for host in rule.hosts:
                    self._allow_ports.setdefault(host, set()).update(ports)
        self._tunnels: dict[tuple[str, int], str] = {}
        for tunnel in tunnels:
            for host in tunnel.hosts:
                for port in tunnel.ports:
                    self._tunnels.setdefault((host, port), tunnel.id)

    def decide(self, method: str, scheme: str, host: str, port: int, path: str) -> Decision:
        # A rule without `methods` means every method a rule could name, never TRACE, CONNECT,
        # PRI or an extension method that no reviewer considered.
        if method not in _KNOWN_METHODS:
            return Decision(Verdict.DENY, Reason.INVALID_METHOD, detail=f"method {method[:20]!r}")
        if scheme not in ("http", "https"):
            return Decision(Verdict.DENY, Reason.INVALID_SCHEME, detail=f"scheme {scheme[:20]!r}")
        if not 1 <= port <= 65535:
            return Decision(Verdict.DENY, Reason.INVALID_PORT, detail=f"port {port}")
        try:
            host = normalize_host(host)
        except NormalizationError as exc:
            return Decision(Verdict.DENY, Reason.INVALID_HOST, detail=str(exc))
        try:
            request_path = normalize_request_path(path.split("?", 1)[0])
        except NormalizationError as exc:
            return Decision(Verdict.DENY, Reason.INVALID_PATH, host=host, detail=str(exc))
        path = request_path.canonical
        endpoint = f"{scheme}:{port}"
        allow: _Entry | None = None
        deny: _Entry | None = None
        push_refs: set[str] | None = set()
        field_rules: dict[int, CompiledHttpRule] | None = {}
        allowed_by: set[str] = set()
        tries = [trie for key in host_keys(host) if (trie := self._by_host.get(key)) is not None]
        # Every rule sees the split reading; an encoded slash's literal reading may only add denials.
        readings = [(list(request_path.segments), True)]
        if request_path.literal_segments is not None:
            readings.append((list(request_path.literal_segments), False))
        for segments, allows in readings:
            for trie in tries:
                for entry in trie.match(segments):
                    if endpoint not in entry.endpoints:
                        continue
                    if entry.methods is not None and method not in entry.methods:
                        continue
                    if entry.rule.action == Verdict.DENY:
                        if deny is None or entry.order < deny.order:
                            deny = entry
                    elif allows:
                        allowed_by.add(entry.rule.id.split(":", 1)[0])
                        if allow is None or entry.order < allow.order:
                            allow = entry
                        # allows are a union: one matching rule without limits allows any ref
                        limits = entry.rule.push_refs
                        push_refs = (
                            None if push_refs is None or limits is None else push_refs | set(limits)
                        )
                        if field_rules is not None and entry.rule.reads_body:
                            field_rules[entry.order] = entry.rule
                        else:
                            field_rules = None
        if deny is not None:
            return Decision(Verdict.DENY, Reason.RULE_DENY, deny.rule.id, host, path)
        if allow is not None:
            return Decision(
                Verdict.ALLOW,
                Reason.RULE_ALLOW,
                allow.rule.id,
                host,
                path,
                push_refs=None if push_refs is None else tuple(sorted(push_refs)),
                allowed_by=tuple(sorted(allowed_by)),
                field_rules=None
                if field_rules is None
                else tuple(field_rules[order] for order in sorted(field_rules)),
            )
        return Decision(Verdict.DENY, Reason.NO_MATCHING_RULE, None, host, path)

    def may_connect(self, host: str, port: int) -> bool:
        """Whether any allow or tunnel rule could admit traffic to host:port (normalized or not).

        False means every request on such a connection would be denied, so a proxy may refuse the
        CONNECT itself; True promises nothing about any single request.
        """
        try:
            host = normalize_host(host)
        except NormalizationError:
            return False
        if (host, port) in self._tunnels:
            return True
        return any(port in self._allow_ports.get(key, ()) for key in host_keys(host))

    def decide_tunnel(self, host: str, port: int) -> Decision:
        try:
            host = normalize_host(host)
        except NormalizationError as exc:
            return Decision(Verdict.DENY, Reason.INVALID_HOST, detail=str(exc))
        rule_id = self._tunnels.get((host, port))
        if rule_id is None:
            return Decision(Verdict.DENY, Reason.NO_MATCHING_RULE, None, host)
        return Decision(Verdict.ALLOW, Reason.RULE_ALLOW, rule_id, host)


@functools.lru_cache(maxsize=1024)
def _ref_glob(pattern: str) -> re.Pattern[str]:
    parts = []
    for index, segment in enumerate(pattern.split("/")):
        if segment == "**":
            parts.append("(?:/[^/]+)*" if index else "[^/]+(?:/[^/]+)*")
        else:
            text = re.escape(segment).replace(r"\*", "[^/]*")
            parts.append(("/" if index else "") + text)
    return re.compile("".join(parts))


def ref_allowed(decision: Decision, ref: str) -> bool:
    """Whether a push the decision allows may change `ref` (`*` within a segment, `**` any
    number of whole segments)."""
    if decision.push_refs is None:
        return True
    return any(_ref_glob(pattern).fullmatch(ref) for pattern in decision.push_refs)


def decide_push(decision: Decision, refs: Sequence[str]) -> Decision:
    """The decision for a git push of `refs` (create, update or delete) that `decision` allowed."""
    if not decision.allowed:
        return decision
    refused = [ref for ref in refs if not ref_allowed(decision, ref)]
    if not refused:
        return decision
    return Decision(
        Verdict.DENY,
        Reason.PUSH_REF_DENIED,
        decision.rule_id,
        decision.host,
        decision.path,
        f"push to {len(refused)} ref(s) outside {list(decision.push_refs or ())}",
        decision.push_refs,
    )
