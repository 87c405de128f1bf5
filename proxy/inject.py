"""Credential injection: after the request is allowed and scanned, set the policy's headers.

Only injections bound to the flow's own connect target apply. Every existing instance of the header
(any case) is removed first, then the rendered value is set once. A missing secret denies the
request rather than sending it without the credential the policy expects.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field

from umbra.policy import CompiledInject
from umbra.proxy.secrets import SecretStore


class InjectionError(Exception):
    def __init__(self, rule_id: str, secret_ref: str) -> None:
        self.rule_id = rule_id
        self.secret_ref = secret_ref
        super().__init__(f"injection {rule_id} needs secret {secret_ref}, which is not set")


@dataclass
class Injected:
    header_names: list[str] = field(default_factory=list)
    values: list[str] = field(default_factory=list)  # kept in memory only, for reflection checks
    refs: set[str] = field(default_factory=set)


def render_injections(
    injections: tuple[CompiledInject, ...], secrets: SecretStore, owner: str, host: str
) -> list[tuple[CompiledInject, str]]:
    rendered: list[tuple[CompiledInject, str]] = []
    for rule in injections:
        value = secrets.resolve(rule.secret, owner, host)
        if value is None:
            raise InjectionError(rule.id, rule.secret)
        rendered.append((rule, rule.render(value)))
    return rendered


def apply_injections(
    headers: MutableMapping[str, str],
    rendered: list[tuple[CompiledInject, str]],
    secrets: SecretStore,
    owner: str,
    host: str,
) -> Injected:
    """Replace each bound header; `headers` is mitmproxy's case-insensitive multi-dict."""
    result = Injected()
    for rule, value in rendered:
        while rule.header in headers:
            del headers[rule.header]
        headers[rule.header] = value
        result.header_names.append(rule.header)
        result.values.append(value)
        raw = secrets.resolve(rule.secret, owner, host)
        if raw is not None:
            result.values.append(raw)
        result.refs.add(rule.secret)
    return result
