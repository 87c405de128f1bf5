"""Rendering: one Jinja2 environment with autoescaping, and a finalizer that makes every value
visible text.

Records carry attacker-chosen hosts, paths and headers. Autoescaping turns markup into text; the
finalizer additionally rewrites control characters, bidirectional overrides, zero-width characters
and lone surrogates as visible `\\uXXXX` escapes (and a backslash as two, so an escape is never
ambiguous), so a value can neither hide itself, reorder the line it sits on, nor break the page's
UTF-8 encoding.
"""

from __future__ import annotations

import unicodedata
from datetime import datetime
from importlib import resources
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup

from umbra.console.db import as_utc

# Cc control, Cf format (bidi overrides, zero-width), Cs lone surrogates, Co private use,
# Zl/Zp line and paragraph separators.
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Co", "Zl", "Zp"})


def visible(value: str) -> str:
    if value.isprintable() and value.isascii() and "\\" not in value:
        return value
    out = []
    for char in value:
        if char == "\\":
            out.append("\\\\")  # so a typed "\\x1b" is not mistaken for an escaped ESC
        elif unicodedata.category(char) in _HIDDEN:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(char)
    return "".join(out)


def _finalize(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, Markup):
        return value
    if isinstance(value, str):
        return visible(value)
    return value


def truncate(value: str | None, limit: int = 120) -> str:
    if value is None:
        return ""
    return value if len(value) <= limit else value[: limit - 1] + "…"


def when(value: datetime | None) -> str:
    if value is None:
        return ""
    return as_utc(value).strftime("%Y-%m-%d %H:%M:%S")


def query(params: dict[str, str]) -> str:
    return urlencode({k: visible(v) for k, v in params.items()}, errors="replace")


def _environment() -> Environment:
    folder = resources.files("umbra.console.web") / "templates"
    env = Environment(
        loader=FileSystemLoader(str(folder)),
        autoescape=True,
        undefined=StrictUndefined,
        finalize=_finalize,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["trunc"] = truncate
    env.filters["when"] = when
    env.filters["query"] = query
    return env


ENV = _environment()


_DEFAULTS: dict[str, Any] = {
    "session": None, "team": None, "nav": "", "flash": None, "is_admin": False
}  # fmt: skip


def render(name: str, **context: Any) -> str:
    return ENV.get_template(name).render({**_DEFAULTS, **context})
