"""Canonical JSON: one byte string per value, so hashes and signatures are reproducible.

Keys sorted, no insignificant white space, UTF-8. Documents hold only strings, integers, booleans,
null, lists and objects; floats are refused because their text form is not unique. The one
variant: `ascii_only=True` escapes every non-ASCII character (as a JSON escape), as rendered compose files
and launch documents are hashed, so no byte depends on an encoding.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def _check(value: Any) -> None:
    if isinstance(value, float):
        raise TypeError("canonical JSON refuses floats")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError("canonical JSON object keys must be strings")
            _check(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _check(item)


def canonical_json(value: Any, *, ascii_only: bool = False) -> bytes:
    _check(value)
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=ascii_only)
    return text.encode()


def canonical_text(value: Any) -> str:
    """ASCII-only canonical JSON as text (measured documents: no byte depends on an encoding)."""
    return canonical_json(value, ascii_only=True).decode("ascii")


def content_hash(value: Any) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(value)).hexdigest()
