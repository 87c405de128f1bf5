"""`umbra secret`: set, rotate and delete write-only secrets bound to hosts; list their names.

The value is read from stdin (when piped) or a hidden prompt, never from argv, and is never
printed: the Console answers with metadata only.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from umbra.cli.auth import api_errors, api_failure, open_client, resolve_team
from umbra.cli.output import EXIT_USAGE, console, fail, print_json

if TYPE_CHECKING:  # for annotations: the client and schemas load when a command runs
    from umbra.console.schemas import SecretInfo

app = typer.Typer(
    help="Write-only secrets, bound to the hosts they may be sent to.", no_args_is_help=True
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
TeamOption = Annotated[
    str | None, typer.Option("--team", help="Team (default: your login's team, or your only one).")
]
PersonalFlag = Annotated[
    bool, typer.Option("--personal", help="Your personal secret (else a team secret; admins).")
]


def _read_value() -> str:
    if sys.stdin.isatty():
        value = str(typer.prompt("Secret value", hide_input=True, confirmation_prompt=True))
    else:
        value = sys.stdin.read()
        # One trailing newline is how `echo` and editors end a line, not part of the secret.
        value = value[:-1] if value.endswith("\n") else value
        value = value[:-1] if value.endswith("\r") else value
    return value


@app.command("set")
def set_secret(
    name: Annotated[str, typer.Argument(help="Secret name ([a-z0-9][a-z0-9._-]*).")],
    host: Annotated[
        list[str], typer.Option("--host", help="A host the secret may be injected for (repeat).")
    ],
    team: TeamOption = None,
    personal: PersonalFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Set a secret; the value comes from stdin or a hidden prompt."""
    if not host:
        fail("pass at least one --host", EXIT_USAGE, as_json=as_json)
    client, login = open_client(as_json)  # before asking for the value: fail fast
    value = _read_value()
    if not value:
        fail("the secret value is empty", EXIT_USAGE, as_json=as_json)
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            if personal:
                info = client.set_personal_secret(team_name, name, value, host)
            else:
                info = client.set_team_secret(team_name, name, value, host)
    except api_errors() as exc:
        api_failure(exc, as_json)
    if as_json:
        print_json(info.model_dump(mode="json"))
    else:
        console.print(
            f"Set [bold]{info.ref}[/] (version {info.version}) for {', '.join(info.hosts)}"
        )


@app.command("list")
def list_secrets(team: TeamOption = None, as_json: JsonFlag = False) -> None:
    """Team secrets and your personal secrets: names, hosts and versions only."""
    client, login = open_client(as_json)
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            rows: list[SecretInfo] = [
                *client.list_secrets(team_name),
                *client.list_secrets(team_name, personal=True),
            ]
    except api_errors() as exc:
        api_failure(exc, as_json)
    if as_json:
        print_json([row.model_dump(mode="json") for row in rows])
        return
    table = Table(title=f"secrets of {team_name}")
    for column in ("ref", "hosts", "version", "updated by", "updated at"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row.ref,
            ", ".join(row.hosts) or "-",
            str(row.version),
            row.updated_by,
            row.updated_at.isoformat(timespec="seconds"),
        )
    console.print(table)


@app.command("delete")
def delete_secret(
    name: Annotated[str, typer.Argument(help="Secret name.")],
    team: TeamOption = None,
    personal: PersonalFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Delete a secret: proxies stop injecting it when they next pull released secrets."""
    client, login = open_client(as_json)
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            client.delete_secret(team_name, name, personal=personal)
    except api_errors() as exc:
        api_failure(exc, as_json)
    ref = f"{'personal' if personal else 'team'}/{name}"
    if as_json:
        print_json({"ok": True, "deleted": ref})
    else:
        console.print(f"Deleted [bold]{ref}[/]")


@app.command("rotate")
def rotate_secret(
    name: Annotated[str, typer.Argument(help="Secret name (must exist).")],
    team: TeamOption = None,
    personal: PersonalFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Replace an existing secret's value, keeping its hosts; the value comes from stdin or a
    hidden prompt."""
    from umbra.console.client import ConsoleApiError

    client, login = open_client(as_json)
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            existing = {row.name: row for row in client.list_secrets(team_name, personal=personal)}
            if name not in existing:
                fail(
                    f"no {'personal' if personal else 'team'} secret {name!r} to rotate",
                    as_json=as_json,
                )
            value = _read_value()
            if not value:
                fail("the secret value is empty", EXIT_USAGE, as_json=as_json)
            # Conditional on the version read: a concurrent rotation (or a host change) is
            # never overwritten silently; the Console answers 412 and nothing is stored.
            read = existing[name]
            if personal:
                info = client.set_personal_secret(
                    team_name, name, value, read.hosts, if_version=read.version
                )
            else:
                info = client.set_team_secret(
                    team_name, name, value, read.hosts, if_version=read.version
                )
    except api_errors() as exc:
        if isinstance(exc, ConsoleApiError) and exc.status == 412:
            fail(
                f"{read.ref} changed since it was read (version {read.version}): someone else "
                "rotated, re-set or deleted it meanwhile; your value was NOT stored. Check "
                "`umbra secret list` and rotate again if it is still needed.",
                as_json=as_json,
            )
        api_failure(exc, as_json)
    if as_json:
        print_json(info.model_dump(mode="json"))
    else:
        console.print(f"Rotated [bold]{info.ref}[/] to version {info.version}")
