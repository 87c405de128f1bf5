"""Credential injection: after the request is allowed and scanned, place the policy's credentials.

Only injections bound to the flow's own connect target (and path, when they name paths) apply.
A header placement removes every existing instance of the header (any case), then sets the
rendered value once; a query placement removes every parameter of that name the sandbox sent
(a placeholder, or anything) and appends `name=<URL-encoded value>`. A missing secret denies the
request rather than sending it without the credential the policy expects.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from urllib.parse import quote, unquote_plus

from umbra.policy import CompiledInject
from umbra.proxy.secrets import SecretStore


class InjectionError(Exception):
    def __init__(self, rule_id: str, secret_ref: str) -> None:
        self.rule_id = rule_id
        self.secret_ref = secret_ref
        super().__init__(f"injection {rule_id} needs secret {secret_ref}, which is not set")


@dataclass(frozen=True)
class Rendered:
    rule: CompiledInject
    headers: list[tuple[str, str]]
    query: tuple[str, str] | None  # (name, URL-encoded value) as it goes on the wire
    # The raw secret values behind this placement (the secret, and the Basic user secret).
    raw: list[str]

    def __repr__(self) -> str:
        return f"Rendered(rule={self.rule.id!r}, values=<redacted>)"


@dataclass
class Injected:
    header_names: list[str] = field(default_factory=list)
    # Kept in memory only, for the reflection guard: every value placed on the wire and every raw
    # value behind it (their encoded forms are derived by `scanner.secret_encodings`).
    values: list[str] = field(default_factory=list)
    refs: set[str] = field(default_factory=set)


def query_value(secret: str) -> str:
    """The one spelling of a secret in a query: every byte but unreserved ones percent-encoded,
    which is exactly the URL form the scanner and the reflection guard already know."""
    return quote(secret, safe="")


def render_injections(
    injections: tuple[CompiledInject, ...],
    secrets: SecretStore,
    owner: str,
    host: str,
    minted: Mapping[str, str] | None = None,
) -> list[Rendered]:
    """`minted`: access tokens minted for this flow (OAuth kinds), by secret ref; they render
    like a static value."""
    rendered: list[Rendered] = []
    for rule in injections:
        if rule.sigv4 is not None:
            continue  # signed, not placed: the SigV4 addon (proxy/sigv4.py)
        values: list[str] = []
        for ref in rule.refs:
            value = minted[ref] if minted and ref in minted else secrets.resolve(ref, owner, host)
            if value is None:
                raise InjectionError(rule.id, ref)
            values.append(value)
        secret, user = values[0], (values[1] if len(values) > 1 else None)
        query = None if rule.query is None else (rule.query, query_value(secret))
        rendered.append(Rendered(rule, rule.render(secret, user), query, values))
    return rendered


def with_query_param(path: str, name: str, encoded: str) -> str:
    """`path` with every `name` parameter removed (however the sandbox spelled the name) and
    `name=encoded` appended; the other parameters are kept as sent."""
    base, _, query = path.partition("?")
    kept = [
        piece
        for piece in query.split("&")
        if piece and unquote_plus(piece.partition("=")[0]) != name
    ]
    return base + "?" + "&".join([*kept, f"{name}={encoded}"])


def apply_injections(
    headers: MutableMapping[str, str], path: str, rendered: list[Rendered]
) -> tuple[str, Injected]:
    """Place each credential; `headers` is mitmproxy's case-insensitive multi-dict. Returns the
    request path to send (with any query placement) and what was injected."""
    result = Injected()
    for item in rendered:
        for name, value in item.headers:
            while name in headers:
                del headers[name]
            headers[name] = value
            result.header_names.append(name)
            result.values.append(value)
        if item.query is not None:
            path = with_query_param(path, *item.query)
            result.values.append(item.query[1])
        result.values.extend(item.raw)
        result.refs.update(item.rule.refs)
    return path, result
