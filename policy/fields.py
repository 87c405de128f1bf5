"""Request-field rules: reading a request body (JSON or a form, with the query's parameters) into
one document, bounded, and checking constraints on its fields by JSON Pointer.

Pure: no proxy, no I/O. `umbra.policy.body.decide_body` applies it (and `umbra.policy.mcp`) to
an allow decision whose rules read the body.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import parse_qsl

from umbra.policy.matcher import Reason
from umbra.policy.model import FieldConstraint

# Bounds on what is parsed: the decoded body, nesting, and members + elements in all.
MAX_BODY_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_ITEMS = 10_000
_DETAIL_NAME = 64
_INDEX = re.compile(r"0|[1-9][0-9]{0,8}")


class BodyError(ValueError):
    """A body that cannot be read as one document (`reason`: body_unreadable or body_limit)."""

    def __init__(self, reason: Reason, message: str) -> None:
        self.reason = reason
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class BodyRequest:
    """What of a request the field rules read. `content_types` holds every Content-Type header
    (a request with two is refused: servers disagree which one counts)."""

    content_types: tuple[str, ...]
    body: bytes
    query: str = ""
    method: str = "POST"


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def _media_type(request: BodyRequest) -> str | None:
    if len(request.content_types) > 1:
        raise BodyError(Reason.BODY_UNREADABLE, "more than one Content-Type header")
    if not request.content_types:
        return None
    return request.content_types[0].split(";", 1)[0].strip().lower()


def _is_json(media: str) -> bool:
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def _reject_constant(name: str) -> object:
    raise BodyError(Reason.BODY_UNREADABLE, f"JSON body holds {name}, which JSON does not define")


def _unique_object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    document = dict(pairs)
    if len(document) != len(pairs):
        # servers disagree whether the first or the last of two equal keys counts
        raise BodyError(Reason.BODY_UNREADABLE, "JSON object names one member twice")
    return document


def _check_bounds(document: object) -> None:
    items = 0
    stack: list[tuple[object, int]] = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                raise BodyError(Reason.BODY_LIMIT, f"body nests deeper than {MAX_DEPTH} levels")
            items += len(value)
            if items > MAX_ITEMS:
                raise BodyError(Reason.BODY_LIMIT, f"body holds more than {MAX_ITEMS} fields")
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)


def _parse_json(body: bytes) -> object:
    try:
        text = body.decode("utf-8")
        return json.loads(text, object_pairs_hook=_unique_object, parse_constant=_reject_constant)
    except RecursionError:
        raise BodyError(Reason.BODY_LIMIT, f"body nests deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise BodyError(Reason.BODY_UNREADABLE, "JSON body is not UTF-8") from None
    except ValueError as exc:
        if isinstance(exc, BodyError):
            raise
        raise BodyError(Reason.BODY_UNREADABLE, "body is not valid JSON") from None


def _parse_form(text: str, what: str) -> list[tuple[str, str]]:
    if not text:
        return []
    try:
        return parse_qsl(
            text,
            keep_blank_values=True,
            strict_parsing=True,
            errors="strict",
            max_num_fields=MAX_ITEMS,
        )
    except UnicodeDecodeError:
        raise BodyError(Reason.BODY_UNREADABLE, f"{what} is not UTF-8 once decoded") from None
    except ValueError as exc:
        if "max" in str(exc).lower():
            raise BodyError(
                Reason.BODY_LIMIT, f"{what} holds more than {MAX_ITEMS} fields"
            ) from None
        raise BodyError(Reason.BODY_UNREADABLE, f"{what} is not a form") from None


def parse_body(request: BodyRequest) -> object:
    """The request's fields as one JSON document: a JSON body as it is, or a form body (and an
    empty body) as an object of strings; the query's parameters join an object as strings.

    Refused: a body over `MAX_BODY_BYTES`, nesting over `MAX_DEPTH` or more than `MAX_ITEMS`
    fields (body_limit); another content type, invalid JSON or UTF-8, NaN/Infinity, a member or
    parameter named twice (in the body, the query, or both), a form that looks like JSON, query
    parameters beside a JSON body that is not an object (body_unreadable)."""
    body = request.body
    if len(body) > MAX_BODY_BYTES:
        raise BodyError(Reason.BODY_LIMIT, f"body exceeds {MAX_BODY_BYTES} bytes")
    media = _media_type(request)
    document: object
    if body and media is not None and _is_json(media):
        document = _parse_json(body)
    elif not body or media == "application/x-www-form-urlencoded":
        if body.lstrip()[:1] in (b"{", b"["):
            raise BodyError(Reason.BODY_UNREADABLE, "form body looks like JSON")
        try:
            text = body.decode("ascii")
        except UnicodeDecodeError:
            raise BodyError(Reason.BODY_UNREADABLE, "form body is not URL-encoded ASCII") from None
        document = _unique_object(list(_parse_form(text, "form body")))
    else:
        kind = (media or "none")[:_DETAIL_NAME]
        raise BodyError(Reason.BODY_UNREADABLE, f"content type {kind} is neither JSON nor a form")
    query = _parse_form(request.query, "query")
    if query:
        if not isinstance(document, dict):
            raise BodyError(Reason.BODY_UNREADABLE, "query parameters beside a non-object body")
        document = _unique_object([*document.items(), *query])
    _check_bounds(document)
    return document


def resolve(document: object, pointer: str) -> object:
    """The value at a JSON Pointer (RFC 6901), or MISSING."""
    if pointer == "":
        return document
    value = document
    for part in pointer[1:].split("/"):
        step = part.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict):
            if step not in value:
                return MISSING
            value = value[step]
        elif isinstance(value, list):
            if not _INDEX.fullmatch(step):
                return MISSING
            index = int(step)
            if index >= len(value):
                return MISSING
            value = value[index]
        else:
            return MISSING
    return value


def _same(a: object, b: object) -> bool:
    # JSON equality: 1 is not true, and not 1.0
    return type(a) is type(b) and a == b


@functools.lru_cache(maxsize=4096)
def _pattern(text: str) -> re.Pattern[str]:
    return re.compile(text)


def violation(document: object, constraint: FieldConstraint) -> str | None:
    """Why the document fails the constraint (naming the field and the condition, never the
    value: it is the agent's data), or None."""
    value = resolve(document, constraint.pointer)
    field = constraint.pointer[:_DETAIL_NAME] or "(the body)"
    match constraint.kind:
        case "absent":
            return None if value is MISSING else f"{field} is present, and must be absent"
        case _ if value is MISSING:
            return f"{field} is missing"
        case "equals":
            return None if _same(value, constraint.equals) else f"{field} is not the allowed value"
        case "one_of":
            values = constraint.one_of or []
            if any(_same(value, allowed) for allowed in values):
                return None
            return f"{field} is not one of the {len(values)} allowed values"
        case _:
            assert constraint.pattern is not None
            if isinstance(value, str) and _pattern(constraint.pattern).fullmatch(value):
                return None
            return f"{field} does not match the allowed pattern"


def violations(document: object, constraints: Sequence[FieldConstraint]) -> list[str]:
    return [text for c in constraints if (text := violation(document, c)) is not None]
