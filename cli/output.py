"""Shared rendering for the CLI: rich for people, JSON for scripts, one exit-code convention.

Exit codes: 0 success, 1 the input was checked and found wanting (policy errors, failed tests,
refused bundle), 2 the command could not run as asked (usage, missing files).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console

if TYPE_CHECKING:  # importing it loads the whole policy package (cryptography): not for --help
    from umbra.policy.errors import PolicyIssue

EXIT_FINDINGS = 1
EXIT_USAGE = 2

console = Console()
stderr = Console(stderr=True)


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")


def print_issues(issues: list[PolicyIssue]) -> None:
    for issue in issues:
        stderr.print(f"[bold red]error:[/] {issue}", highlight=False, markup=True, soft_wrap=True)


def fail(
    message: str, code: int = EXIT_FINDINGS, *, fix: str = "", as_json: bool = False
) -> NoReturn:
    """The CLI's one way to stop on an error: `error: MESSAGE` (and `fix: WHAT TO DO` when there
    is one) on stderr, or with --json `{"ok": false, "error": ..., "fix": ...}` on stdout (`fix`
    only when there is one); then exit with `code`."""
    if as_json:
        print_json({"ok": False, "error": message, **({"fix": fix} if fix else {})})
    else:
        stderr.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
        if fix:
            stderr.print(f"[bold]fix:[/] {fix}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)
