"""The import layers of Umbra's top-level parts, stated once; a new upward import fails here.

Read from the source with `ast` (imports inside functions count too), so a lazy import cannot
hide an edge. A part may import only the parts listed for it; the layers, lowest first:

    contracts                      wire contracts: imports nothing of Umbra's
    attest, policy                 attestation; the policy model (each on contracts only)
    sandbox, proxy                 the Dev CVM's pieces; the Security CVM's proxy
    components, images, emulated   Pulumi components; measured images; the emulated clouds
    console                        the control plane
    cli                            the `umbra` command: may import every part

Inside the Console, the service layer (`console/services/`) is HTTP-free: it imports neither
the routes nor the web view nor FastAPI, and the routes do not import the web view.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

ALLOWED: dict[str, frozenset[str]] = {
    "contracts": frozenset(),
    "attest": frozenset({"contracts"}),
    "policy": frozenset({"contracts"}),
    "sandbox": frozenset({"attest", "contracts"}),
    "proxy": frozenset({"policy", "attest", "contracts"}),
    "components": frozenset({"sandbox", "attest", "contracts"}),
    "images": frozenset({"components", "sandbox", "attest", "contracts"}),
    "emulated": frozenset({"components", "attest", "contracts"}),
    "console": frozenset({"emulated", "components", "sandbox", "policy", "attest", "contracts"}),
    "cli": frozenset(
        {"console", "images", "emulated", "components", "proxy", "sandbox", "policy"}
        | {"attest", "contracts"}
    ),
}

# (importing module prefix, imported module prefix): an edge inside a part that must not exist.
FORBIDDEN_INSIDE: tuple[tuple[str, str], ...] = (
    ("umbra.console.services", "umbra.console.routes"),
    ("umbra.console.services", "umbra.console.web"),
    ("umbra.console.services", "fastapi"),
    ("umbra.console.services", "starlette"),
    ("umbra.console.routes", "umbra.console.web"),
)


def _modules() -> Iterator[tuple[str, Path]]:
    for part in ALLOWED:
        for path in sorted((ROOT / part).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            yield "umbra." + ".".join(parts), path


def _imports(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """Absolute names this module imports (relative imports resolved), with their line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], base]).rstrip(".")
            yield base, node.lineno
            for alias in node.names:  # `from umbra.console import routes` names a module too
                yield f"{base}.{alias.name}", node.lineno


def _edges() -> list[tuple[str, str, Path, int]]:
    return [
        (module, imported, path, line)
        for module, path in _modules()
        for imported, line in _imports(module, path)
    ]


def _part(name: str) -> str | None:
    pieces = name.split(".")
    return pieces[1] if len(pieces) > 1 and pieces[0] == "umbra" else None


def test_every_top_level_part_is_stated() -> None:
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()} - {
        "tests",
        "benchmarks",
        "infra",
        "stacks",
        "policies",
        "scripts",
        "docs",
    }
    assert packages == set(ALLOWED), "a new top-level part needs its line in ALLOWED"


def test_no_upward_import() -> None:
    bad: dict[tuple[Path, int], str] = {}
    for module, imported, path, line in _edges():
        mine, theirs = _part(module), _part(imported)
        if theirs is None or theirs == mine or mine is None:
            continue
        if theirs not in ALLOWED[mine]:
            bad.setdefault(
                (path, line), f"{path.relative_to(ROOT)}:{line}: {mine} imports {imported}"
            )
    assert not bad, "imports against the layers:\n" + "\n".join(bad.values())


@pytest.mark.parametrize(("importer", "imported"), FORBIDDEN_INSIDE)
def test_forbidden_edge_inside_a_part(importer: str, imported: str) -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line}: imports {name}"
        for module, name, path, line in _edges()
        if (module == importer or module.startswith(importer + "."))
        and (name == imported or name.startswith(imported + "."))
    ]
    assert not bad, f"{importer} must not import {imported}:\n" + "\n".join(bad)


def test_the_checker_sees_a_lazy_upward_import(tmp_path: Path) -> None:
    """The reader finds an import inside a function and a relative one (else the test is blind)."""
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from umbra.console import app\nfrom ..cli import x\n")
    names = {name for name, _ in _imports("umbra.contracts.mod", source)}
    assert names == {"umbra.console", "umbra.console.app", "umbra.cli", "umbra.cli.x"}
