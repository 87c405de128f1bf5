"""The `umbra` command: a thin typer app that parses, calls the other parts and renders with rich.

Sub-commands load on first use, so `umbra policy check` does not import mitmproxy, FastAPI or the
Pulumi SDKs, and `umbra --help` imports none of them: it lists the commands from the static table
below (a test keeps each line equal to its module's own help). The top level renders its help with
click's plain formatter, not rich: typer's rich help imports rich's markdown, traceback and pretty
modules (~0.13 s of the 0.2 s budget; benchmarks/cli_help_bench.py). Sub-command help stays rich.
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer import _click as click  # typer vendors click; TyperGroup speaks these types
from typer.core import TyperCommand, TyperGroup

# name -> (module, attribute holding its typer.Typer, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "attest": ("umbra.cli.attest", "app", "Verify TDX attestation quotes; simulate a TEE."),
    "audit": ("umbra.cli.audit", "app", "The Console's hash-chained audit log (admins)."),
    "auth": ("umbra.cli.auth", "app", "Log in to an Umbra Console."),
    "config": ("umbra.cli.config", "app", "The umbra client's configuration."),
    "console": (
        "umbra.cli.console",
        "app",
        "Run and maintain the Umbra Console (settings come from UMBRA_CONSOLE_* variables).",
    ),
    "cvm": ("umbra.cli.cvm", "app", "Launch, list, update and destroy CVMs."),
    "down": ("umbra.cli.up", "down_app", "Stop everything `umbra up` started."),
    "forwarder": ("umbra.cli.sandbox", "forwarder_app", "The Dev CVM's attested egress forwarder."),
    "image": (
        "umbra.cli.image",
        "app",
        "Measure CVM releases: compose hash, RTMR3 events, signed manifests.",
    ),
    "logs": ("umbra.cli.logs", "app", "Query the traffic log."),
    "policy": ("umbra.cli.policy", "app", "Lint, test, diff, build and verify egress policy."),
    "profile": (
        "umbra.cli.profile",
        "app",
        "Attach policy profiles to Dev CVMs and set team defaults (admins).",
    ),
    "proxy": ("umbra.cli.proxy", "app", "The Security CVM's policy-enforcing egress proxy."),
    "quota": (
        "umbra.cli.quota",
        "app",
        "The team's Dev CVM quotas: show (everyone), set (admins).",
    ),
    "sandbox": (
        "umbra.cli.sandbox",
        "app",
        "Dev CVM sandbox: release documents and agent sessions.",
    ),
    "secret": (
        "umbra.cli.secret",
        "app",
        "Write-only secrets, bound to the hosts they may be sent to.",
    ),
    "sessions": ("umbra.cli.sessions", "app", "Your sandbox's agent sessions."),
    "status": ("umbra.cli.up", "status_app", "What `umbra up` started, and whether it is healthy."),
    "up": ("umbra.cli.up", "up_app", "Start Umbra on this machine (embedded defaults)."),
    "usage": ("umbra.cli.usage", "app", "LLM token usage per day, developer, CVM and model."),
    "user": (
        "umbra.cli.user",
        "app",
        "People in a team: deactivate or reactivate a developer (admins).",
    ),
}
# name -> (module, attribute holding a one-command typer.Typer, one-line help): top-level
# commands rather than groups
COMMANDS: dict[str, tuple[str, str, str]] = {
    "claude": (
        "umbra.cli.ssh",
        "claude_app",
        "Attach to (or start) Claude Code in your sandbox, permission prompts off.",
    ),
    "code": (
        "umbra.cli.ssh",
        "code_app",
        "Open VS Code on your sandbox via Remote-SSH (writes the ~/.ssh/config block first).",
    ),
    "codex": (
        "umbra.cli.ssh",
        "codex_app",
        "Attach to (or start) Codex in your sandbox, approvals off.",
    ),
    "connect": (
        "umbra.cli.connect",
        "connect_app",
        "Store your agent login as a personal secret and attach its profile to your Dev CVM(s).",
    ),
    "disconnect": (
        "umbra.cli.connect",
        "disconnect_app",
        "Detach the agent's profile from your Dev CVM(s) and delete your stored login.",
    ),
    "config-ssh": (
        "umbra.cli.ssh",
        "config_ssh_app",
        "Write one `Host umbra-<name>` per Dev CVM into a managed block of ~/.ssh/config.",
    ),
    "cursor": (
        "umbra.cli.ssh",
        "cursor_app",
        "Open Cursor on your sandbox via Remote-SSH (writes the ~/.ssh/config block first).",
    ),
    "machine-types": (
        "umbra.cli.quota",
        "machine_types_app",
        "The machine types and data disk sizes Dev CVMs of the team may launch with.",
    ),
    "version": ("umbra.cli.version", "app", "Print umbra's version and the Python running it."),
    "shell": (
        "umbra.cli.ssh",
        "shell_app",
        "Attach to (or start) a persistent shell session in your sandbox.",
    ),
    "ssh": (
        "umbra.cli.ssh",
        "ssh_app",
        "Open a shell (or run a command) in your sandbox over attested SSH.",
    ),
    "ssh-proxy": (
        "umbra.cli.ssh",
        "proxy_app",
        "OpenSSH ProxyCommand: verify the Dev CVM's quote, then relay stdin/stdout.",
    ),
}


# `umbra claude|codex connect|disconnect …` (the spelling) is `umbra connect|disconnect
# claude|codex …`: one command, reached both ways. The verb stands where `umbra claude` takes a
# Dev CVM name, so a CVM named `connect` or `disconnect` is reached by its id there.
AGENT_LOGIN_VERBS = ("connect", "disconnect")


class LazyGroup(TyperGroup):
    _listing = False

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if len(args) >= 2 and args[0] in ("claude", "codex") and args[1] in AGENT_LOGIN_VERBS:
            args = [args[1], args[0], *args[2:]]
        return super().resolve_command(ctx, args)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *SUBCOMMANDS, *COMMANDS})

    def format_help(self, ctx: click.Context, formatter: Any) -> None:
        # While help is rendered, sub-commands are stand-ins carrying only their help line.
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS:
            module_name, attribute, help_text = COMMANDS[cmd_name]
            if self._listing:
                return TyperCommand(name=cmd_name, help=help_text)
            single = typer.main.get_command(
                getattr(importlib.import_module(module_name), attribute)
            )
            single.name = cmd_name
            return single
        if cmd_name not in SUBCOMMANDS:
            return super().get_command(ctx, cmd_name)
        module_name, attribute, help_text = SUBCOMMANDS[cmd_name]
        if self._listing:
            return TyperGroup(name=cmd_name, help=help_text)
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
    rich_markup_mode=None,  # plain top-level help: see the module docstring
)


@app.callback()
def umbra() -> None:
    """Attested confidential sandboxes for AI coding agents."""


def main() -> None:
    app()
