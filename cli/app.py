"""The `umbra` command: a thin typer app that parses, calls the other parts and renders with rich.

Sub-commands load on first use, so `umbra policy check` does not import mitmproxy, FastAPI or the
Pulumi SDKs; only `umbra --help` loads them all, to list them.
"""

from __future__ import annotations

import importlib

import typer
from typer import _click as click  # typer vendors click; TyperGroup speaks these types
from typer.core import TyperGroup

# name -> (module, attribute holding its typer.Typer)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "attest": ("umbra.cli.attest", "app"),
    "auth": ("umbra.cli.auth", "app"),
    "console": ("umbra.cli.console", "app"),
    "down": ("umbra.cli.up", "down_app"),
    "cvm": ("umbra.cli.cvm", "app"),
    "forwarder": ("umbra.cli.sandbox", "forwarder_app"),
    "image": ("umbra.cli.image", "app"),
    "logs": ("umbra.cli.logs", "app"),
    "policy": ("umbra.cli.policy", "app"),
    "proxy": ("umbra.cli.proxy", "app"),
    "sandbox": ("umbra.cli.sandbox", "app"),
    "secret": ("umbra.cli.secret", "app"),
    "status": ("umbra.cli.up", "status_app"),
    "up": ("umbra.cli.up", "up_app"),
}
# name -> (module, attribute holding a one-command typer.Typer): top-level commands, not groups
COMMANDS: dict[str, tuple[str, str]] = {
    "claude": ("umbra.cli.ssh", "claude_app"),
    "code": ("umbra.cli.ssh", "code_app"),
    "codex": ("umbra.cli.ssh", "codex_app"),
    "config-ssh": ("umbra.cli.ssh", "config_ssh_app"),
    "cursor": ("umbra.cli.ssh", "cursor_app"),
    "sessions": ("umbra.cli.ssh", "sessions_app"),
    "shell": ("umbra.cli.ssh", "shell_app"),
    "ssh": ("umbra.cli.ssh", "ssh_app"),
    "ssh-proxy": ("umbra.cli.ssh", "proxy_app"),
}


class LazyGroup(TyperGroup):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *SUBCOMMANDS, *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS:
            module_name, attribute = COMMANDS[cmd_name]
            single = typer.main.get_command(
                getattr(importlib.import_module(module_name), attribute)
            )
            single.name = cmd_name
            return single
        if cmd_name not in SUBCOMMANDS:
            return super().get_command(ctx, cmd_name)
        module_name, attribute = SUBCOMMANDS[cmd_name]
        sub_app = getattr(importlib.import_module(module_name), attribute)
        command = typer.main.get_group(sub_app)
        command.name = cmd_name
        return command


app = typer.Typer(
    name="umbra",
    cls=LazyGroup,
    help="Attested confidential sandboxes for AI coding agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def umbra() -> None:
    """Attested confidential sandboxes for AI coding agents."""


def main() -> None:
    app()
