"""Routes are thin adapters over `console/services/`: a route module neither raises
`HTTPException` (a refusal is a domain error, mapped to HTTP once in routes/errors.py) nor queries
the database itself (no sqlalchemy/sqlmodel import). Read from the source with `ast`.

`NOT_YET` names the modules that still do, each to move to a service; the list may only shrink (a
module on it that became thin fails here until it is taken off)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROUTES = Path(__file__).resolve().parents[2] / "console" / "routes"
NOT_YET: frozenset[str] = frozenset()


def _thickness(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(call, ast.Name) and call.id == "HTTPException":
                found.append(f"line {node.lineno}: raises HTTPException")
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
            "sqlalchemy",
            "sqlmodel",
        ):
            found.append(f"line {node.lineno}: imports {node.module}")
    return found


MODULES = sorted(p for p in ROUTES.glob("*.py") if p.stem not in ("__init__", "errors"))


@pytest.mark.parametrize("path", MODULES, ids=[p.stem for p in MODULES])
def test_route_module_is_thin(path: Path) -> None:
    found = _thickness(path)
    if path.stem in NOT_YET:
        assert found, f"{path.name} is thin now: take it off NOT_YET"
    else:
        assert found == [], f"{path.name}: {found}"
