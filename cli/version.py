"""`umbra version`: which umbra and which Python run this command (for bug reports and support)."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Annotated

import typer

from umbra.cli.output import console, print_json

app = typer.Typer(add_completion=False)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


def package_version() -> str:
    try:
        return metadata.version("umbra")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown (not installed)"


@app.command("version")
def version(as_json: JsonFlag = False) -> None:
    """Print umbra's version and the Python running it."""
    info = {
        "umbra": package_version(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "platform": platform.platform(terse=True),
    }
    if as_json:
        print_json(info)
        return
    console.print(
        f"umbra {info['umbra']} (Python {info['python']}, {info['platform']})",
        markup=False,
        highlight=False,
    )
