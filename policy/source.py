"""YAML loading that remembers where every value came from and refuses duplicate keys.

PyYAML silently keeps the last of two equal keys, which would let a reviewer read one rule while the
loader applies another. Here mappings and sequences are built as `Located` containers that carry the
line of each key or item, so a validation error can be pointed at its line.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import yaml

from umbra.policy.errors import PolicyError

MAX_POLICY_FILE_BYTES = 1 << 20


class LocatedDict(dict[str, Any]):
    line: int
    key_lines: dict[str, int]


class LocatedList(list[Any]):
    line: int
    item_lines: list[int]


class _Loader(yaml.SafeLoader):
    """SafeLoader with duplicate-key rejection and line tracking (1-based lines)."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> LocatedDict:
    loader.flatten_mapping(node)
    result = LocatedDict()
    result.line = node.start_mark.line + 1
    result.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, Hashable) or not isinstance(key, str):
            raise yaml.constructor.ConstructorError(
                None, None, f"mapping keys must be strings, found {key!r}", key_node.start_mark
            )
        if key in result:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first at line {result.key_lines[key]})",
                key_node.start_mark,
            )
        result[key] = loader.construct_object(value_node, deep=True)
        result.key_lines[key] = key_node.start_mark.line + 1
    return result


def _construct_sequence(loader: _Loader, node: yaml.SequenceNode) -> LocatedList:
    result = LocatedList(loader.construct_object(child, deep=True) for child in node.value)
    result.line = node.start_mark.line + 1
    result.item_lines = [child.start_mark.line + 1 for child in node.value]
    return result


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


def load_yaml(path: Path, display_name: str | None = None) -> Any:
    """Parse one YAML document; errors become a PolicyError naming file and line."""
    name = display_name or str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PolicyError.single(name, None, "", f"cannot read file: {exc.strerror}") from None
    if len(raw) > MAX_POLICY_FILE_BYTES:
        raise PolicyError.single(
            name, None, "", f"file is larger than {MAX_POLICY_FILE_BYTES} bytes"
        )
    return parse_yaml(raw, name)


def parse_yaml(raw: bytes, name: str) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError.single(name, None, "", f"file is not UTF-8 (byte {exc.start})") from None
    try:
        documents = list(yaml.load_all(text, Loader=_Loader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = exc.problem or exc.context or "invalid YAML"
        raise PolicyError.single(name, line, "", problem) from None
    except yaml.YAMLError as exc:
        raise PolicyError.single(name, None, "", f"invalid YAML: {exc}") from None
    if len(documents) != 1:
        raise PolicyError.single(
            name, None, "", f"expected one YAML document, found {len(documents)}"
        )
    return documents[0]


def line_of(data: Any, loc: Sequence[int | str]) -> int | None:
    """The line of the deepest located value on the path `loc` (a pydantic error location)."""
    line: int | None = getattr(data, "line", None)
    node = data
    for part in loc:
        if isinstance(node, LocatedDict) and isinstance(part, str) and part in node:
            line = node.key_lines.get(part, line)
            node = node[part]
        elif isinstance(node, LocatedList) and isinstance(part, int) and 0 <= part < len(node):
            line = node.item_lines[part]
            node = node[part]
        else:
            break
    return line


def field_path(loc: Sequence[int | str]) -> str:
    """Render a pydantic location as `egress[2].allow.methods[0]`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out
