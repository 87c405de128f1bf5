"""The compiled form of a profile: every default filled in, every id qualified by its profile.

This is what a signed bundle carries and what the proxy enforces. The same field validators as the
source format apply on load, so a bundle holding a non-canonical host or path is refused even when
its signature is good.
"""

from __future__ import annotations

import base64
import re
from typing import Annotated, Self

from pydantic import (
    AfterValidator,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from umbra.contracts.traffic import Decision
from umbra.policy.model import (
    INJECT_DEFAULT_PORT,
    PLACEHOLDER,
    SCHEME_DEFAULT_PORTS,
    Action,
    ExactHost,
    FieldConstraints,
    HeaderName,
    HostPattern,
    InjectFormat,
    InjectRule,
    Limit,
    McpRule,
    Method,
    Name,
    PathPattern,
    Per,
    Port,
    Profile,
    QueryName,
    RefPattern,
    ScanRegex,
    SecretRef,
    StrictModel,
)

_QUALIFIED_ID = re.compile(
    r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?:[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$"
)
_ENDPOINT = re.compile(r"^(https?):([0-9]{1,5})$")


def _check_qualified_id(value: str) -> str:
    if not _QUALIFIED_ID.match(value):
        raise ValueError("must be 'profile:rule'")
    return value


def _check_endpoint(value: str) -> str:
    match = _ENDPOINT.match(value)
    if (
        not match
        or not 1 <= int(match.group(2)) <= 65535
        or str(int(match.group(2))) != match.group(2)
    ):
        raise ValueError("must be 'https:PORT' or 'http:PORT'")
    return value


RuleId = Annotated[str, AfterValidator(_check_qualified_id)]
Endpoint = Annotated[str, AfterValidator(_check_endpoint)]


class CompiledHttpRule(StrictModel):
    id: RuleId
    action: Action
    hosts: list[HostPattern] = Field(min_length=1)
    methods: list[Method] | None
    endpoints: list[Endpoint] = Field(min_length=1)
    paths: list[PathPattern] | None
    push_refs: list[RefPattern] | None
    body: FieldConstraints | None = None
    mcp: McpRule | None = None

    @model_serializer(mode="wrap")
    def _without_unset_limits(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # Rules without body or MCP limits serialize as before they existed: bundles and policy
        # hashes of profiles that do not use them are unchanged.
        data: dict[str, object] = handler(self)
        for limit in ("body", "mcp"):
            if data.get(limit) is None:
                data.pop(limit, None)
        return data

    @property
    def reads_body(self) -> bool:
        return self.body is not None or self.mcp is not None


class CompiledTunnel(StrictModel):
    id: RuleId
    hosts: list[ExactHost] = Field(min_length=1)
    ports: list[Port] = Field(min_length=1)


class CompiledScan(StrictModel):
    id: RuleId
    regex: ScanRegex


class CompiledHeader(StrictModel):
    name: HeaderName
    format: InjectFormat


class CompiledSigv4(StrictModel):
    services: list[str] = Field(min_length=1)
    regions: list[str] = Field(min_length=1)


class CompiledInject(StrictModel):
    """Where one secret goes: `headers` (each set once) and/or a `query` parameter, for HTTPS
    requests to `hosts` on `ports` and, when `paths` is given, on those paths only. With
    `user_secret`, the `{basic}` placeholder is base64(user_secret value:secret value)."""

    id: RuleId
    secret: SecretRef
    hosts: list[ExactHost] = Field(min_length=1)
    ports: list[Port] = Field(min_length=1)
    paths: list[PathPattern] | None = None
    headers: list[CompiledHeader] = Field(default_factory=list)
    query: QueryName | None = None
    user_secret: SecretRef | None = None
    sigv4: CompiledSigv4 | None = None

    @model_serializer(mode="wrap")
    def _omit_no_sigv4(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """Bundles signed before `sigv4` existed dump (and so verify) byte for byte as before."""
        data: dict[str, object] = handler(self)
        if self.sigv4 is None:
            data.pop("sigv4", None)
        return data

    @model_validator(mode="after")
    def _placed(self) -> Self:
        if self.sigv4 is not None:
            if self.headers or self.query is not None or self.user_secret is not None:
                raise ValueError("a sigv4 injection places nothing else")
            return self
        if not self.headers and self.query is None:
            raise ValueError("an injection needs a header or a query parameter")
        basic = any("{basic}" in header.format for header in self.headers)
        if basic != (self.user_secret is not None):
            raise ValueError("'{basic}' and 'user_secret' go together")
        return self

    @property
    def placements(self) -> list[str]:
        """What the injection sets: header names, and `?name` for the query parameter."""
        if self.sigv4 is not None:
            return ["Authorization"]  # or the presigned query's X-Amz-Signature
        return [header.name for header in self.headers] + (
            [f"?{self.query}"] if self.query is not None else []
        )

    @property
    def refs(self) -> list[str]:
        return [self.secret] + ([self.user_secret] if self.user_secret is not None else [])

    def render(self, secret: str, user: str | None = None) -> list[tuple[str, str]]:
        """(header name, value) for each header: `{secret}` is the value itself, `{basic:USER}`
        base64(USER:value), `{basic}` base64(user:value) with `user` the user_secret's value."""
        for value in (secret, user or ""):
            if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
                raise ValueError(f"secret for {self.id} contains a control character")
        if self.user_secret is not None and (user is None or ":" in user or not user):
            raise ValueError(f"user secret {self.user_secret} is not a Basic user name")
        rendered: list[tuple[str, str]] = []
        for header in self.headers:
            match = PLACEHOLDER.search(header.format)
            assert match is not None  # InjectFormat guarantees exactly one placeholder
            placeholder = match.group(1)
            if placeholder == "secret":
                value = secret
            else:
                name = user if placeholder == "basic" else placeholder.removeprefix("basic:")
                value = base64.b64encode(f"{name}:{secret}".encode()).decode("ascii")
            fmt = header.format
            rendered.append((header.name, fmt[: match.start()] + value + fmt[match.end() :]))
        return rendered


class CompiledBudget(StrictModel):
    """A budget (policy.md, Budgets): `rules` qualified, `hosts` sorted."""

    id: RuleId
    per: Per
    hosts: list[HostPattern] | None
    rules: list[RuleId] | None
    requests_per_minute: Limit | None
    bytes_per_day: Limit | None
    tokens_per_month: Limit | None


class CompiledProfile(StrictModel):
    name: Name
    description: str | None
    rules: list[CompiledHttpRule]
    tunnels: list[CompiledTunnel]
    scan: list[CompiledScan]
    inject: list[CompiledInject]
    sandbox_env: dict[str, str] = Field(default_factory=dict)
    budgets: list[CompiledBudget] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_empty_additions(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """Profiles without `sandbox_env` or `budgets` dump (hash, sign) byte for byte as before
        they existed."""
        data: dict[str, object] = handler(self)
        if not self.sandbox_env:
            data.pop("sandbox_env", None)
        if not self.budgets:
            data.pop("budgets", None)
        return data


def _endpoints(schemes: list[str], ports: list[int] | None) -> list[str]:
    if ports is None:
        pairs = {f"{scheme}:{SCHEME_DEFAULT_PORTS[scheme]}" for scheme in schemes}
    else:
        pairs = {f"{scheme}:{port}" for scheme in schemes for port in ports}
    return sorted(pairs)


def compile_profile(profile: Profile) -> tuple[CompiledProfile, dict[str, tuple[str, int]]]:
    """Compile one validated profile.

    Returns the compiled profile and, for each qualified id, the (section, index) it came from, so a
    caller holding source locations can point at the rule. Duplicate ids raise ValueError with the
    (section, index) of the second one.
    """
    origins: dict[str, tuple[str, int]] = {}

    def qualify(local: str | None, default: str, section: str, index: int) -> str:
        rule_id = f"{profile.name}:{local or default}"
        if rule_id in origins:
            raise DuplicateRuleId(rule_id, section, index, origins[rule_id])
        origins[rule_id] = (section, index)
        return rule_id

    rules: list[CompiledHttpRule] = []
    tunnels: list[CompiledTunnel] = []
    for index, entry in enumerate(profile.egress):
        rule_id = qualify(entry.id, f"egress-{index}", "egress", index)
        if entry.tunnel is not None:
            tunnels.append(
                CompiledTunnel(
                    id=rule_id,
                    hosts=sorted(set(entry.tunnel.hosts)),
                    ports=sorted(set(entry.tunnel.ports)),
                )
            )
            continue
        action = Decision.ALLOW if entry.allow is not None else Decision.DENY
        match = entry.allow or entry.deny
        assert match is not None  # guaranteed by EgressRule's validator
        rules.append(
            CompiledHttpRule(
                id=rule_id,
                action=action,
                hosts=sorted(set(match.hosts)),
                methods=sorted(set(match.methods)) if match.methods else None,
                endpoints=_endpoints(list(match.schemes), match.ports),
                paths=sorted(set(match.paths)) if match.paths else None,
                push_refs=sorted(set(entry.push_refs)) if entry.push_refs else None,
                body=entry.body,
                mcp=entry.mcp,
            )
        )
    scan = [
        CompiledScan(id=qualify(rule.id, "", "scan", index), regex=rule.regex)
        for index, rule in enumerate(profile.scan)
    ]
    inject = [
        _compile_inject(rule, qualify(rule.id, f"inject-{index}", "inject", index))
        for index, rule in enumerate(profile.inject)
    ]
    budgets = []
    allow_ids = {rule.id for rule in rules if rule.action is Decision.ALLOW}
    for index, budget in enumerate(profile.budgets):
        budget_id = qualify(budget.id, "", "budgets", index)
        named = [f"{profile.name}:{local}" for local in budget.rules or []]
        unknown = [rule_id for rule_id in named if rule_id not in allow_ids]
        if unknown:
            raise UnknownRule(unknown[0], "budgets", index)
        budgets.append(
            CompiledBudget(
                id=budget_id,
                per=budget.per,
                hosts=sorted(set(budget.hosts)) if budget.hosts else None,
                rules=sorted(set(named)) if budget.rules else None,
                requests_per_minute=budget.requests_per_minute,
                bytes_per_day=budget.bytes_per_day,
                tokens_per_month=budget.tokens_per_month,
            )
        )
    compiled = CompiledProfile(
        name=profile.name,
        description=profile.description,
        rules=rules,
        tunnels=tunnels,
        scan=scan,
        inject=inject,
        sandbox_env=dict(sorted(profile.sandbox_env.items())),
        budgets=budgets,
    )
    return compiled, origins


def _compile_inject(rule: InjectRule, rule_id: str) -> CompiledInject:
    if rule.basic is not None:
        user = rule.basic.user
        fmt = "Basic {basic}" if user is None else f"Basic {{basic:{user}}}"
        headers = [CompiledHeader(name="Authorization", format=fmt)]
    elif rule.headers is not None:
        headers = [CompiledHeader(name=h.header, format=h.format) for h in rule.headers]
    elif rule.header is not None and rule.format is not None:
        headers = [CompiledHeader(name=rule.header, format=rule.format)]
    else:
        headers = []
    return CompiledInject(
        id=rule_id,
        secret=rule.secret,
        hosts=sorted(set(rule.hosts)),
        ports=sorted(set(rule.ports or [INJECT_DEFAULT_PORT])),
        paths=sorted(set(rule.paths)) if rule.paths else None,
        headers=headers,
        query=rule.query,
        user_secret=rule.basic.user_secret if rule.basic is not None else None,
        sigv4=CompiledSigv4(
            services=sorted(set(rule.sigv4.services)), regions=sorted(set(rule.sigv4.regions))
        )
        if rule.sigv4 is not None
        else None,
    )


class UnknownRule(ValueError):
    def __init__(self, rule_id: str, section: str, index: int) -> None:
        self.rule_id, self.section, self.index = rule_id, section, index
        super().__init__(f"names {rule_id!r}, which is not an allow rule of this profile")


class DuplicateRuleId(ValueError):
    def __init__(self, rule_id: str, section: str, index: int, first: tuple[str, int]) -> None:
        self.rule_id, self.section, self.index = rule_id, section, index
        super().__init__(f"duplicate rule id {rule_id!r} (first used at {first[0]}[{first[1]}])")
