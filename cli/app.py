"""The `umbra` command: a thin typer app that parses, calls the other parts and renders with rich."""

from __future__ import annotations

import typer

from umbra.cli import attest as attest_cli
from umbra.cli import image as image_cli
from umbra.cli import policy as policy_cli
from umbra.cli import proxy as proxy_cli
from umbra.cli import sandbox as sandbox_cli

app = typer.Typer(
    name="umbra",
    help="Attested confidential sandboxes for AI coding agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(policy_cli.app, name="policy")
app.add_typer(proxy_cli.app, name="proxy")
app.add_typer(attest_cli.app, name="attest")
app.add_typer(image_cli.app, name="image")
app.add_typer(sandbox_cli.app, name="sandbox")
app.add_typer(sandbox_cli.forwarder_app, name="forwarder")


def main() -> None:
    app()
