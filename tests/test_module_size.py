"""Small modules with one concern: a package module over `LIMIT` lines says at the top of its
docstring why it is one module (a paragraph starting with `MARKER`), or it is split by concern."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "umbra"
LIMIT = 500
MARKER = "Why one module:"


def _modules() -> list[Path]:
    # src/umbra/<package> are symlinks to the top-level package folders.
    return sorted(p for package in PACKAGE.iterdir() for p in package.resolve().rglob("*.py"))


def _large() -> list[Path]:
    return [p for p in _modules() if len(p.read_text().splitlines()) > LIMIT]


def test_the_scan_sees_the_packages() -> None:
    assert len(_modules()) > 100  # guards against a path change that makes the next test vacuous


@pytest.mark.parametrize("path", _large(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_large_module_says_why_it_is_one(path: Path) -> None:
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert MARKER in docstring, (
        f"{path}: {len(path.read_text().splitlines())} lines; split it by concern, or write "
        f"'{MARKER} ...' in its docstring"
    )
