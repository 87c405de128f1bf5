"""The profile file format (`apiVersion: umbra/v1`, `kind: Profile`) as strict pydantic models.

Validation here is per file; rules that need several profiles at once (deny wins, conflicting
injections, unique ids) live in `compose`.

Why one module: it is the profile file format, one schema; its field checks sit beside the fields
they check, and `umbra policy schema` publishes the JSON schema of these models as one document."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from umbra.contracts.sandbox_env import ENV_NAME, MAX_ENV_VARS, check_env_value
from umbra.contracts.traffic import Decision
from umbra.policy.normalize import (
    NormalizationError,
    is_ip_literal,
    normalize_host,
    normalize_path,
)
from umbra.policy.sandbox_env import credential_rule

API_VERSION = "umbra/v1"
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
SCHEME_DEFAULT_PORTS = {"https": 443, "http": 80}
# Injections are made over TLS only, so their ports are HTTPS ports.
INJECT_DEFAULT_PORT = SCHEME_DEFAULT_PORTS["https"]
ANY_HOST = "*"
MAX_SCAN_REGEX_LENGTH = 1024
MAX_FIELD_CONSTRAINTS = 64
MAX_POINTER_LENGTH = 256
MAX_MCP_TOOLS = 256

# Hop-by-hop and framing headers: injecting them would change how the request is delimited or
# routed rather than how it is authenticated.
FORBIDDEN_INJECT_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "content-type",
        "host",
        "expect",
    }
)

RESERVED_PROFILE_NAMES = frozenset({"builtin"})

_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")
_HEADER_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$")
_SECRET_REF = re.compile(r"^(team|personal)/([a-z0-9](?:[a-z0-9._-]{0,126}[a-z0-9])?)$")
PLACEHOLDER = re.compile(r"\{(secret|basic|basic:[^{}]+)\}")
# A query parameter name the proxy sets: unreserved characters only, so its spelling is unique.
_QUERY_NAME = re.compile(r"^[A-Za-z0-9._~-]{1,128}$")
# Constructs Hyperscan and RE2 do not implement; refusing them here keeps one engine for all rules.
_UNSUPPORTED_REGEX = re.compile(r"\(\?<?[=!]|\(\?P=|\(\?\(|\\[1-9]|\\[gk]<")


def _check_name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError("must be lowercase letters, digits and '-', 1 to 64 characters")
    return value


def _check_host_pattern(value: str) -> str:
    """`example.com`, `*.example.com` (strict subdomains at any depth), an IP literal, or `*`."""
    if value == ANY_HOST:
        return value
    wildcard = value.startswith("*.")
    name = value[2:] if wildcard else value
    if "*" in name:
        raise ValueError("a wildcard may only be a leading '*.' label")
    try:
        normalized = normalize_host(name)
    except NormalizationError as exc:
        raise ValueError(str(exc)) from None
    if wildcard and is_ip_literal(normalized):
        raise ValueError("a wildcard cannot prefix an IP address")
    return "*." + normalized if wildcard else normalized


def _check_exact_host(value: str) -> str:
    value = _check_host_pattern(value)
    if "*" in value:
        raise ValueError("must be an exact host name, not a wildcard")
    return value


def _check_path_pattern(value: str) -> str:
    """A path glob: `*` matches within one segment, a `**` segment matches any number of them."""
    try:
        canonical = normalize_path(value)
    except NormalizationError as exc:
        raise ValueError(str(exc)) from None
    if canonical != value:
        raise ValueError(f"path pattern is not in canonical form; write {canonical!r}")
    for segment in value.split("/"):
        if "**" in segment and segment != "**":
            raise ValueError("'**' must be a whole path segment")
    return value


_REF_PATTERN = re.compile(r"^refs/[A-Za-z0-9._/*-]{1,240}$")


def _check_ref_pattern(value: str) -> str:
    """A git ref glob: `*` within one segment, a `**` segment any number of them."""
    if not _REF_PATTERN.match(value):
        raise ValueError("must start with 'refs/' and use letters, digits, '.', '_', '-', '/', '*'")
    segments = value.split("/")
    if any(not segment for segment in segments) or ".." in value:
        raise ValueError("empty segments and '..' are not ref names")
    if any("**" in segment and segment != "**" for segment in segments):
        raise ValueError("'**' must be a whole segment")
    return value


def _check_scan_regex(value: str) -> str:
    if not value:
        raise ValueError("regex must not be empty")
    if len(value) > MAX_SCAN_REGEX_LENGTH:
        raise ValueError(f"regex is longer than {MAX_SCAN_REGEX_LENGTH} characters")
    if _UNSUPPORTED_REGEX.search(value):
        raise ValueError("look-around and back-references are not supported (Hyperscan/RE2 subset)")
    try:
        compiled = re.compile(value)
    except re.error as exc:
        raise ValueError(f"invalid regex: {exc}") from None
    if compiled.match(""):
        raise ValueError("regex matches the empty string, so it would flag every request")
    return value


def _check_field_pattern(value: str) -> str:
    if len(value) > MAX_SCAN_REGEX_LENGTH:
        raise ValueError(f"pattern is longer than {MAX_SCAN_REGEX_LENGTH} characters")
    if _UNSUPPORTED_REGEX.search(value):
        raise ValueError("look-around and back-references are not supported (Hyperscan/RE2 subset)")
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"invalid regex: {exc}") from None
    return value


_POINTER = re.compile(r"^(?:/(?:[^~/]|~[01])*)*$")


def _check_pointer(value: str) -> str:
    """A JSON Pointer (RFC 6901): '' (the whole document) or '/a/b', '~0' for '~', '~1' for '/'."""
    if len(value) > MAX_POINTER_LENGTH:
        raise ValueError(f"pointer is longer than {MAX_POINTER_LENGTH} characters")
    if not _POINTER.match(value):
        raise ValueError("must be a JSON Pointer: '' or '/field/0/sub' ('~0' is '~', '~1' is '/')")
    if any(ord(char) < 0x20 for char in value):
        raise ValueError("contains a control character")
    return value


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_./-]{1,128}$")


def _check_tool_name(value: str) -> str:
    if not _TOOL_NAME.match(value):
        raise ValueError("an MCP tool name of letters, digits, '_', '-', '.', '/' (1-128)")
    return value


def check_header_name(value: str) -> str:
    if not _HEADER_TOKEN.match(value):
        raise ValueError("not a valid HTTP header name")
    if value.lower() in FORBIDDEN_INJECT_HEADERS:
        raise ValueError(f"{value!r} is a hop-by-hop or framing header and cannot be injected")
    return value


def _check_format(value: str) -> str:
    placeholders = PLACEHOLDER.findall(value)
    if len(placeholders) != 1:
        raise ValueError("must contain exactly one '{secret}' or '{basic:USER}' placeholder")
    if "{" in PLACEHOLDER.sub("", value) or "}" in PLACEHOLDER.sub("", value):
        raise ValueError("has a brace outside its placeholder")
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
        raise ValueError("contains a control character")
    return value


def check_query_name(value: str) -> str:
    if not _QUERY_NAME.match(value):
        raise ValueError("a query parameter name of letters, digits, '.', '_', '~', '-'")
    return value


def _check_basic_user(value: str) -> str:
    # The user is the part before the first ':' of the decoded credentials (RFC 7617).
    if not value or any(c in ":{}" or ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError("a non-empty user without ':', braces or control characters")
    return value


def _check_secret_ref(value: str) -> str:
    if not _SECRET_REF.match(value):
        raise ValueError(
            "must be 'team/NAME' or 'personal/NAME' (lowercase, digits, '.', '_', '-')"
        )
    return value


Name = Annotated[str, AfterValidator(_check_name)]
HostPattern = Annotated[str, AfterValidator(_check_host_pattern)]
ExactHost = Annotated[str, AfterValidator(_check_exact_host)]
PathPattern = Annotated[str, AfterValidator(_check_path_pattern)]
# A rule's or test case's allow/deny, the traffic record's Decision; documents spell it as a string
# (so not strict: the enum's value is accepted, and only its values).
Action = Annotated[Decision, Field(strict=False)]
Method = Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
Scheme = Literal["https", "http"]
Port = Annotated[int, Field(ge=1, le=65535, strict=True)]
ScanRegex = Annotated[str, AfterValidator(_check_scan_regex)]
RefPattern = Annotated[str, AfterValidator(_check_ref_pattern)]
HeaderName = Annotated[str, AfterValidator(check_header_name)]
InjectFormat = Annotated[str, AfterValidator(_check_format)]
SecretRef = Annotated[str, AfterValidator(_check_secret_ref)]
QueryName = Annotated[str, AfterValidator(check_query_name)]
BasicUser = Annotated[str, AfterValidator(_check_basic_user)]
JsonPointer = Annotated[str, AfterValidator(_check_pointer)]
FieldPattern = Annotated[str, AfterValidator(_check_field_pattern)]
ToolName = Annotated[str, AfterValidator(_check_tool_name)]
# Values a field constraint compares with: JSON scalars without floats (whose text form is not
# unique, so canonical JSON refuses them).
FieldValue = str | int | bool | None
_CONSTRAINT_KINDS = ("equals", "one_of", "pattern", "absent")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)


class FieldConstraint(StrictModel):
    """One field of a request body, named by JSON Pointer, and exactly one condition on it:
    `equals` a value, is `one_of` the values, is a string that `pattern` matches in full, or is
    `absent`. A field a condition other than `absent` names must be present."""

    pointer: JsonPointer
    equals: FieldValue = None
    one_of: list[FieldValue] | None = Field(default=None, min_length=1, max_length=1024)
    pattern: FieldPattern | None = None
    absent: Literal[True] | None = None

    @model_validator(mode="after")
    def _one_condition(self) -> Self:
        given = [kind for kind in _CONSTRAINT_KINDS if kind in self.model_fields_set]
        if len(given) != 1:
            raise ValueError("needs exactly one of 'equals', 'one_of', 'pattern' or 'absent'")
        if given[0] != "equals" and getattr(self, given[0]) is None:
            raise ValueError(f"'{given[0]}' must not be null")
        return self

    @property
    def kind(self) -> str:
        return next(kind for kind in _CONSTRAINT_KINDS if kind in self.model_fields_set)

    @model_serializer(mode="wrap")
    def _only_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # `equals: null` is a condition, an omitted one is not: serialize only what was given.
        data: dict[str, object] = handler(self)
        return {"pointer": data["pointer"], self.kind: data[self.kind]}


FieldConstraints = Annotated[
    list[FieldConstraint], Field(min_length=1, max_length=MAX_FIELD_CONSTRAINTS)
]


class McpTool(StrictModel):
    """One MCP tool an agent may call, optionally with constraints on its `arguments` (pointers
    relative to the call's `params.arguments`)."""

    name: ToolName
    arguments: FieldConstraints | None = None


class McpRule(StrictModel):
    tools: list[McpTool] = Field(min_length=1, max_length=MAX_MCP_TOOLS)

    @field_validator("tools")
    @classmethod
    def _distinct(cls, value: list[McpTool]) -> list[McpTool]:
        names = [tool.name for tool in value]
        if len(set(names)) != len(names):
            raise ValueError("names one tool twice")
        return value


class HttpMatch(StrictModel):
    """Which HTTP requests a rule covers; an omitted field means 'any'."""

    hosts: list[HostPattern] = Field(min_length=1)
    methods: list[Method] | None = Field(default=None, min_length=1)
    schemes: list[Scheme] = Field(default_factory=lambda: list[Scheme](["https"]), min_length=1)
    ports: list[Port] | None = Field(
        default=None, min_length=1, description="Default: 443 for https, 80 for http."
    )
    paths: list[PathPattern] | None = Field(default=None, min_length=1)


class TunnelMatch(StrictModel):
    """Raw TCP to exact hosts and ports, uninspected: the explicit exception to HTTP inspection."""

    hosts: list[ExactHost] = Field(min_length=1)
    ports: list[Port] = Field(min_length=1)


class EgressRule(StrictModel):
    """One `allow`, `deny` or `tunnel` entry; `id` names it in logs (default `egress-N`)."""

    id: Name | None = None
    comment: str | None = None
    allow: HttpMatch | None = None
    deny: HttpMatch | None = None
    tunnel: TunnelMatch | None = None
    push_refs: list[RefPattern] | None = Field(
        default=None,
        min_length=1,
        description="allow only: a git push (git-receive-pack) it allows may create, update or "
        "delete only refs matching these patterns, e.g. 'refs/heads/agent/**'.",
    )
    body: FieldConstraints | None = Field(
        default=None,
        description="allow only: every request it allows must have a JSON or form body (with the "
        "query's parameters) whose fields meet every constraint.",
    )
    mcp: McpRule | None = Field(
        default=None,
        description="allow only: the MCP server (streamable HTTP) it allows may be called only "
        "for these tools; the protocol's own methods pass.",
    )

    @model_validator(mode="after")
    def _exactly_one_kind(self) -> Self:
        kinds = [kind for kind in ("allow", "deny", "tunnel") if getattr(self, kind) is not None]
        if len(kinds) != 1:
            raise ValueError("each egress entry needs exactly one of 'allow', 'deny' or 'tunnel'")
        for limit in ("push_refs", "body", "mcp"):
            if getattr(self, limit) is not None and self.allow is None:
                raise ValueError(f"'{limit}' limits an 'allow' rule only")
        limits = [name for name in ("push_refs", "body", "mcp") if getattr(self, name) is not None]
        if len(limits) > 1:
            raise ValueError(f"one body limit per rule: {' and '.join(limits)} both read the body")
        if self.allow is not None and ANY_HOST in self.allow.hosts:
            raise ValueError("'*' (every host) may appear in deny rules only")
        return self


class ScanRule(StrictModel):
    id: Name
    regex: ScanRegex
    description: str | None = None


class HeaderPlacement(StrictModel):
    """One header an injection sets: `format` with its placeholder filled in."""

    header: HeaderName
    format: InjectFormat


class BasicPlacement(StrictModel):
    """`Authorization: Basic base64(user:secret)`, the user given or itself a secret."""

    user: BasicUser | None = None
    user_secret: SecretRef | None = None

    @model_validator(mode="after")
    def _one_user(self) -> Self:
        if (self.user is None) == (self.user_secret is None):
            raise ValueError("needs exactly one of 'user' or 'user_secret'")
        return self


AwsName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]


class Sigv4Placement(StrictModel):
    """Re-sign the sandbox's AWS Signature V4 (made with placeholder keys) with the real key of an
    `aws-sigv4` secret, only when its credential scope names one of these services and regions."""

    services: list[AwsName] = Field(min_length=1, max_length=32)
    regions: list[AwsName] = Field(min_length=1, max_length=64)


EnvName = Annotated[str, Field(pattern=ENV_NAME)]


class InjectRule(StrictModel):
    """Place `secret` in HTTPS requests to `hosts` on `ports` (and `paths`, when given) only:
    another service on the same host, or another path, never gets the credential.

    The placement is exactly one of: `header` + `format` (one header), `headers` (several),
    `query` (a query parameter set to the URL-encoded value), `basic` (HTTP Basic) or `sigv4`
    (the request's AWS signature made again with the real key)."""

    id: Name | None = None
    header: HeaderName | None = None
    format: InjectFormat | None = None
    headers: list[HeaderPlacement] | None = Field(default=None, min_length=1)
    query: QueryName | None = None
    basic: BasicPlacement | None = None
    sigv4: Sigv4Placement | None = None
    secret: SecretRef
    hosts: list[ExactHost] = Field(min_length=1)
    ports: list[Port] | None = Field(
        default=None,
        min_length=1,
        description="Default: 443 (credentials are injected over HTTPS only).",
    )
    paths: list[PathPattern] | None = Field(
        default=None, min_length=1, description="Default: every path (as in allow rules)."
    )

    @model_validator(mode="after")
    def _one_placement(self) -> Self:
        placements = ("header", "headers", "query", "basic", "sigv4")
        given = [name for name in placements if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(
                "needs exactly one of 'header', 'headers', 'query', 'basic' or 'sigv4'"
            )
        if (self.header is None) != (self.format is None):
            raise ValueError("'header' and 'format' go together")
        return self

    @field_validator("format")
    @classmethod
    def _no_bare_basic(cls, value: str | None) -> str | None:
        if value is not None and "{basic}" in value:
            raise ValueError("'{basic}' is written 'basic: {user_secret: ...}'")
        return value

    @field_validator("headers")
    @classmethod
    def _distinct_headers(cls, value: list[HeaderPlacement] | None) -> list[HeaderPlacement] | None:
        for placement in value or []:
            cls._no_bare_basic(placement.format)
        names = [placement.header.lower() for placement in value or []]
        if len(set(names)) != len(names):
            raise ValueError("names one header twice (case-insensitive)")
        return value


Limit = Annotated[int, Field(ge=1, le=(1 << 62), strict=True)]


class BudgetPer(StrEnum):
    """Whose counter a budget keeps: each CVM's, or each owner's over all their CVMs."""

    CVM = "cvm"
    OWNER = "owner"


# documents spell it as a string (not strict: the enum's values are accepted, only those)
Per = Annotated[BudgetPer, Field(strict=False)]


class Budget(StrictModel):
    """A limit on what a CVM (or each owner, over all their CVMs) may spend on the requests it
    covers: those to `hosts`, or those the profile's allow rules named in `rules` decide."""

    id: Name
    comment: str | None = None
    per: Per
    hosts: list[HostPattern] | None = Field(default=None, min_length=1)
    rules: list[Name] | None = Field(default=None, min_length=1)
    requests_per_minute: Limit | None = None
    bytes_per_day: Limit | None = Field(
        default=None, description="Bytes sent and received, per UTC day."
    )
    tokens_per_month: Limit | None = Field(
        default=None,
        description="LLM tokens (input + output, as the API reports them), per UTC month.",
    )

    @model_validator(mode="after")
    def _scoped_and_limited(self) -> Self:
        if (self.hosts is None) == (self.rules is None):
            raise ValueError("needs exactly one of 'hosts' or 'rules'")
        if not (self.requests_per_minute or self.bytes_per_day or self.tokens_per_month):
            raise ValueError(
                "needs at least one of 'requests_per_minute', 'bytes_per_day', 'tokens_per_month'"
            )
        return self


def _check_profile_name(value: str) -> str:
    if value in RESERVED_PROFILE_NAMES:
        raise ValueError(f"{value!r} is reserved")
    return value


class Profile(StrictModel):
    api_version: Literal["umbra/v1"] = Field(alias="apiVersion")
    kind: Literal["Profile"]
    name: Annotated[Name, AfterValidator(_check_profile_name)]
    description: str | None = None
    egress: list[EgressRule] = Field(default_factory=list)
    scan: list[ScanRule] = Field(default_factory=list)
    inject: list[InjectRule] = Field(default_factory=list)
    budgets: list[Budget] = Field(default_factory=list)
    sandbox_env: dict[EnvName, str] = Field(
        default_factory=dict,
        max_length=MAX_ENV_VARS,
        description="Non-secret variables and placeholders for every sandbox this profile is "
        "attached to; a value that looks like a credential (scan rules) is refused.",
    )

    @field_validator("sandbox_env")
    @classmethod
    def _env_holds_no_credential(
        cls, value: dict[str, str], info: ValidationInfo
    ) -> dict[str, str]:
        # `scan` is declared (and so validated) before `sandbox_env`: its rules apply too.
        own = [(f"scan:{rule.id}", rule.regex) for rule in info.data.get("scan", [])]
        for name, text in value.items():
            try:
                check_env_value(name, text)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
            rule = credential_rule(text, own)
            if rule is not None:
                raise ValueError(
                    f"{name} looks like a real credential ({rule}); store the secret with "
                    "`umbra secret set` and put a placeholder here"
                )
        return value
