"""One way to say what pydantic refused: `field.path: message`, never the input (it may be a
secret value). Every part that turns a `ValidationError` into an error line uses these."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError


def location(loc: Sequence[int | str], top: str = "") -> str:
    """`a.b.0.c` for pydantic's `loc`; `top` where the error is the whole document's."""
    return ".".join(str(part) for part in loc) or top


def lines(exc: ValidationError, top: str = "value") -> list[str]:
    """Every error as `location: message`; no input is echoed."""
    return [
        f"{location(error['loc'], top)}: {error['msg']}"
        for error in exc.errors(include_input=False, include_url=False)
    ]


def problems(exc: ValidationError, top: str = "value", sep: str = "; ") -> str:
    """Every error as `location: message`, joined."""
    return sep.join(lines(exc, top))


def first_problem(exc: ValidationError, top: str = "") -> str:
    """The first error as `location: message` (just the message where it has no location)."""
    error = exc.errors(include_input=False, include_url=False)[0]
    where = location(error["loc"], top)
    return f"{where}: {error['msg']}" if where else error["msg"]
