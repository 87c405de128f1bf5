"""Policy test suites (`kind: PolicyTest`): requests and the decision a reviewer expects for each."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal, Self
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, model_validator

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

    @model_validator(mode="after")
    def _one_probe(self) -> Self:
        if (self.request is None) == (self.tunnel is None):
            raise ValueError("each case needs exactly one of 'request' or 'tunnel'")
        if self.tunnel is not None and self.inject is not None:
            raise ValueError("tunnels are not inspected, so nothing is injected into them")
        if self.tunnel is not None and self.push is not None:
            raise ValueError("'push' describes an HTTP request (git-receive-pack), not a tunnel")
        return self

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
