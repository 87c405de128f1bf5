"""One way to say what pydantic refused: `field.path: message`, never the input (it may be a
secret value). Every part that turns a `ValidationError` into a one-line error uses these."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError


def location(loc: Sequence[int | str], top: str = "") -> str:
    """`a.b.0.c` for pydantic's `loc`; `top` where the error is the whole document's."""
    return ".".join(str(part) for part in loc) or top


def problems(exc: ValidationError, top: str = "value", sep: str = "; ") -> str:
    """Every error as `location: message`, joined; no input is echoed."""
    return sep.join(
        f"{location(error['loc'], top)}: {error['msg']}"
        for error in exc.errors(include_input=False)
    )
