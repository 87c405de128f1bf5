"""Policy test suites (`kind: PolicyTest`): requests and the decision a reviewer expects for each."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Literal, Self
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, JsonValue, model_validator

from umbra.policy.fields import BodyRequest
from umbra.policy.matcher import Decision
from umbra.policy.model import (
    SCHEME_DEFAULT_PORTS,
    Action,
    Name,
    StrictModel,
    check_header_name,
    check_query_name,
)

_REQUEST = re.compile(r"^([A-Z]{1,20}) (\S+)$")
_TUNNEL = re.compile(r"^(\S+):([0-9]{1,5})$")


@dataclass(frozen=True)
class HttpProbe:
    method: str
    scheme: str
    host: str
    port: int
    path: str

    def __str__(self) -> str:
        return f"{self.method} {self.scheme}://{self.host}:{self.port}{self.path}"


@dataclass(frozen=True)
class TunnelProbe:
    host: str
    port: int

    def __str__(self) -> str:
        return f"tunnel {self.host}:{self.port}"


def parse_request(value: str) -> HttpProbe:
    """`METHOD URL`, e.g. `GET https://github.com/acme/x.git/info/refs?service=git-upload-pack`."""
    match = _REQUEST.match(value)
    if not match:
        raise ValueError("must be 'METHOD URL', e.g. 'GET https://example.com/path'")
    method, url = match.groups()
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"invalid URL: {exc}") from None
    if parts.scheme not in SCHEME_DEFAULT_PORTS:
        raise ValueError("URL scheme must be http or https")
    if not parts.hostname or parts.username is not None or parts.password is not None:
        raise ValueError("URL needs a host and no user information")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return HttpProbe(
        method, parts.scheme, parts.hostname, port or SCHEME_DEFAULT_PORTS[parts.scheme], path
    )


def parse_tunnel(value: str) -> TunnelProbe:
    match = _TUNNEL.match(value)
    if not match or not 1 <= int(match.group(2)) <= 65535:
        raise ValueError("must be 'HOST:PORT'")
    return TunnelProbe(match.group(1), int(match.group(2)))


def _check_request(value: str) -> str:
    parse_request(value)
    return value


def _check_ref(value: str) -> str:
    if not value.startswith("refs/") or any(
        ord(char) <= 0x20 or ord(char) == 0x7F for char in value
    ):
        raise ValueError("a ref is 'refs/...' without spaces or control characters")
    return value


def _check_tunnel(value: str) -> str:
    parse_tunnel(value)
    return value


def _check_placement(value: str) -> str:
    """A header name, or `?name` for a query parameter (as `CompiledInject.placements`)."""
    if value.startswith("?"):
        return "?" + check_query_name(value[1:])
    return check_header_name(value)


class Case(StrictModel):
    name: str | None = None
    request: Annotated[str, AfterValidator(_check_request)] | None = None
    tunnel: Annotated[str, AfterValidator(_check_tunnel)] | None = None
    expect: Action
    rule: str | None = Field(default=None, description="Expected rule id, e.g. 'github:git-read'.")
    reason: str | None = Field(default=None, description="Expected reason code, e.g. 'rule_deny'.")
    inject: list[Annotated[str, AfterValidator(_check_placement)]] | None = Field(
        default=None,
        description="Exact set of placements expected: header names, '?name' for a query "
        "parameter.",
    )
    push: list[Annotated[str, AfterValidator(_check_ref)]] | None = Field(
        default=None,
        min_length=1,
        description="The request is a git push changing these refs (checked against push_refs).",
    )
    budgets: list[str] | None = Field(
        default=None,
        description="Exact set of budget ids that cover the request, e.g. ['github:api-rate'].",
    )
    body: str | None = Field(
        default=None,
        max_length=1 << 20,
        description="The request's body as text, checked against body/mcp rules "
        "(with content_type).",
    )
    json_body: JsonValue | None = Field(
        default=None,
        alias="json",
        description="The request's body as a JSON value (sent as application/json).",
    )
    content_type: str | None = Field(
        default=None, description="Content-Type of 'body' (default application/json)."
    )

    @model_validator(mode="after")
    def _one_probe(self) -> Self:
        if (self.request is None) == (self.tunnel is None):
            raise ValueError("each case needs exactly one of 'request' or 'tunnel'")
        if self.tunnel is not None and self.inject is not None:
            raise ValueError("tunnels are not inspected, so nothing is injected into them")
        if self.tunnel is not None and self.push is not None:
            raise ValueError("'push' describes an HTTP request (git-receive-pack), not a tunnel")
        has_body = self.body is not None or "json_body" in self.model_fields_set
        if self.body is not None and "json_body" in self.model_fields_set:
            raise ValueError("'body' and 'json' are two spellings of one body: give one")
        if has_body and self.tunnel is not None:
            raise ValueError("a tunnel is not inspected, so it has no body to check")
        if has_body and self.push is not None:
            raise ValueError("'push' and a body describe two different requests")
        if self.budgets is not None and self.tunnel is not None:
            raise ValueError("budgets cover HTTP requests, not tunnels")
        if self.content_type is not None and self.body is None:
            raise ValueError("'content_type' goes with 'body'")
        return self

    def body_request(self, probe: HttpProbe) -> BodyRequest | None:
        """The body this case sends, for `decide_body`; None when it gives none."""
        query = probe.path.partition("?")[2]
        if "json_body" in self.model_fields_set:
            raw = json.dumps(self.json_body).encode()
            return BodyRequest(("application/json",), raw, query, probe.method)
        if self.body is None:
            return None
        content_type = self.content_type or "application/json"
        return BodyRequest((content_type,), self.body.encode(), query, probe.method)

    def probe(self) -> HttpProbe | TunnelProbe:
        if self.request is not None:
            return parse_request(self.request)
        assert self.tunnel is not None
        return parse_tunnel(self.tunnel)


class Suite(StrictModel):
    api_version: Literal["umbra/v1"] = Field(alias="apiVersion")
    kind: Literal["PolicyTest"]
    name: Name
    profiles: list[Name] = Field(
        description="The profiles composed for these cases; [] tests the empty (deny-all) policy."
    )
    cases: list[Case] = Field(min_length=1)


@dataclass(frozen=True)
class CaseResult:
    file: str
    line: int | None
    suite: str
    case: str
    passed: bool
    expected: str
    actual: Decision
    problems: tuple[str, ...]
