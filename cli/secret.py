"""`umbra secret`: set, rotate and delete write-only secrets bound to hosts; list their names.

The value is read from stdin (when piped) or a hidden prompt, never from argv, and is never
printed: the Console answers with metadata only.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from umbra.cli.auth import api_errors, api_failure, open_client, resolve_team, team_call
from umbra.cli.output import EXIT_USAGE, console, fail, print_json

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


KIND_HELP = (
    "static (a value), oauth2-refresh, oauth2-client-credentials, google-service-account (a Google "
    "key file is accepted as is), github-app (app_id, installation_id, private_key, api_url) or "
    "aws-sigv4: the kinds but static take a JSON document"
)


def _read_file(path: str) -> str:
    """A kind's document from a file or `-` (stdin); the text is never printed."""
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise typer.BadParameter(f"{path}: cannot read ({reason})", param_hint="--file") from None


def _checked(kind: str, text: str, as_json: bool) -> str:
    """Validate locally before anything is sent: errors name fields, never values."""
    from pydantic import ValidationError

    from umbra.contracts.secret_kinds import SecretKind, material_text, parse_material
    from umbra.contracts.validation import problems

    try:
        return material_text(parse_material(SecretKind(kind), text))
    except ValidationError as exc:
        fail(f"{kind} secret: {problems(exc)}", EXIT_USAGE, as_json=as_json)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)


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
    kind: Annotated[str, typer.Option("--kind", help=KIND_HELP)] = "static",
    file: Annotated[
        str | None,
        typer.Option("--file", help="Read the value or document from this file ('-': stdin)."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Set a secret; the value comes from --file, stdin or a hidden prompt, and is never shown."""
    from umbra.contracts.secret_kinds import SecretKind

    if not host:
        fail("pass at least one --host", EXIT_USAGE, as_json=as_json)
    if kind not in set(SecretKind):
        fail(f"--kind: expected one of {', '.join(SecretKind)}", EXIT_USAGE, as_json=as_json)
    if kind != SecretKind.static and file is None:
        fail(
            f"--kind {kind} takes its JSON document with --file F (or '-')",
            EXIT_USAGE,
            as_json=as_json,
        )
    client, login = open_client(as_json)  # before asking for the value: fail fast
    value = _read_value() if file is None else _read_file(file)
    if kind == SecretKind.static and file is not None:
        value = value.removesuffix("\n").removesuffix("\r")
    if not value.strip():
        fail("the secret value is empty", EXIT_USAGE, as_json=as_json)
    value = _checked(kind, value, as_json)
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            if personal:
                info = client.set_personal_secret(team_name, name, value, host, kind=kind)
            else:
                info = client.set_team_secret(team_name, name, value, host, kind=kind)
    except api_errors() as exc:
        api_failure(exc, as_json)
    if as_json:
        print_json(info.model_dump(mode="json"))
    else:
        console.print(
            f"Set [bold]{info.ref}[/] ({info.kind}, version {info.version}) for "
            f"{', '.join(info.hosts)}"
        )


@app.command("list")
def list_secrets(team: TeamOption = None, as_json: JsonFlag = False) -> None:
    """Team secrets and your personal secrets: names, hosts and versions only."""
    team_name, rows = team_call(
        team,
        as_json,
        lambda c, t: [*c.list_secrets(t), *c.list_secrets(t, personal=True)],
    )
    if as_json:
        print_json([row.model_dump(mode="json") for row in rows])
        return
    table = Table(title=f"secrets of {team_name}")
    for column in ("ref", "kind", "status", "hosts", "version", "updated by", "updated at"):
        table.add_column(column)
    for row in rows:
        status = "[red]needs login[/]" if row.status == "needs_login" else "ok"
        table.add_row(
            row.ref,
            str(row.kind),
            status,
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
    team_call(team, as_json, lambda c, t: c.delete_secret(t, name, personal=personal))
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
            value = _checked(read.kind, value, as_json)  # a kind's document stays that kind
            if personal:
                info = client.set_personal_secret(
                    team_name, name, value, read.hosts, if_version=read.version, kind=read.kind
                )
            else:
                info = client.set_team_secret(
                    team_name, name, value, read.hosts, if_version=read.version, kind=read.kind
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
