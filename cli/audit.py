"""`umbra audit`: read a team's audit log and check its entries against their hashes (admins).

A team admin sees the team's entries only, while the chain runs through every team's entries, so
`verify` here recomputes each entry's hash over its content and its `prev_hash` (an edited entry
fails) and checks sequence order; the whole chain, links included, is verified by the operator
with `umbra console audit-verify` against the database.

`export` writes the entries as NDJSON (one `AuditEntryOut` per line, `prev_hash` and `hash`
included) so a security team can keep and check them offline: `verify --file FILE` recomputes
every line's hash, checks the sequence order, and checks each link where two exported entries
are adjacent in the chain (`prev_hash` = the previous entry's `hash`). Entries of other teams
between them are not exported, so those links are checked by the operator's full verification.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from umbra.cli.auth import team_call
from umbra.cli.output import EXIT_FINDINGS, EXIT_USAGE, console, fail, print_json

if TYPE_CHECKING:  # for annotations: the client and schemas load when a command runs
    from umbra.console.client import ConsoleClient
    from umbra.console.schemas import AuditEntryOut

app = typer.Typer(help="The Console's hash-chained audit log (admins).", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
TeamOption = Annotated[str | None, typer.Option("--team", help="Team (default: yours).")]


def _entries(client: ConsoleClient, team: str, limit: int | None) -> list[AuditEntryOut]:
    entries: list[AuditEntryOut] = []
    after = 0
    while True:
        page = client.audit(team, after=after, limit=1000)
        entries.extend(page.entries)
        if page.next_cursor is None or (limit is not None and len(entries) >= limit):
            return entries if limit is None else entries[-limit:]
        after = page.next_cursor


@app.command("list")
def list_entries(
    team: TeamOption = None,
    limit: Annotated[int, typer.Option(min=1, help="Show the newest N entries.")] = 50,
    as_json: JsonFlag = False,
) -> None:
    """Audit entries in chain order: who did what to which target."""
    team_name, entries = team_call(team, as_json, lambda c, t: _entries(c, t, None)[-limit:])
    if as_json:
        print_json([entry.model_dump(mode="json") for entry in entries])
        return
    table = Table(title=f"audit log of {team_name}")
    for column in ("seq", "time", "actor", "action", "target"):
        table.add_column(column, overflow="fold")
    for entry in entries:
        table.add_row(
            str(entry.seq),
            entry.time.strftime("%Y-%m-%d %H:%M:%S"),
            entry.actor,
            entry.action,
            entry.target,
        )
    console.print(table)


@app.command()
def export(
    team: TeamOption = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here (default: stdout).")
    ] = None,
) -> None:
    """The team's audit entries as NDJSON, with the chain's hashes (`verify --file` checks it)."""
    from umbra.contracts.files import write_atomic

    team_name, entries = team_call(team, False, lambda c, t: _entries(c, t, None))
    lines = "".join(entry.model_dump_json() + "\n" for entry in entries)
    if output is None:
        sys.stdout.write(lines)
        return
    write_atomic(output, lines.encode(), 0o600)
    console.print(f"{len(entries)} audit entries of {team_name} written to {output}")


def _read_export(path: Path, as_json: bool) -> list[AuditEntryOut]:
    from pydantic import ValidationError

    from umbra.console.schemas import AuditEntryOut

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"{path}: cannot read ({type(exc).__name__})", EXIT_USAGE, as_json=as_json)
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entries.append(AuditEntryOut.model_validate(json.loads(line)))
        except json.JSONDecodeError as exc:
            fail(f"{path}:{number}: not JSON ({exc.msg})", EXIT_USAGE, as_json=as_json)
        except ValidationError as exc:
            error = exc.errors()[0]
            field = ".".join(str(part) for part in error["loc"]) or "(entry)"
            fail(f"{path}:{number}: {field}: {error['msg']}", EXIT_USAGE, as_json=as_json)
    return entries


@app.command()
def verify(
    team: TeamOption = None,
    file: Annotated[
        Path | None,
        typer.Option("--file", help="Check an `umbra audit export` file offline (no Console)."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Recompute every entry's hash; exit 1 at the first that does not match its content."""
    from umbra.console.audit import entry_hash

    if file is not None:
        entries = _read_export(file, as_json)
        label = str(file)
    else:
        team_name, entries = team_call(team, as_json, lambda c, t: _entries(c, t, None))
        label = f"team {team_name}"
    previous: AuditEntryOut | None = None
    for entry in entries:
        recomputed = entry_hash(
            entry.prev_hash,
            entry.seq,
            entry.time,
            entry.actor,
            entry.team,
            entry.action,
            entry.target,
            dict(entry.details),
        )
        if recomputed != entry.hash or (previous is not None and entry.seq <= previous.seq):
            fail(
                f"audit entry {entry.seq} does not match its hash (edited or reordered)",
                EXIT_FINDINGS,
                as_json=as_json,
            )
        if (
            previous is not None
            and entry.seq == previous.seq + 1
            and (entry.prev_hash != previous.hash)
        ):
            fail(
                f"audit entry {entry.seq} does not link to entry {previous.seq} (chain broken)",
                EXIT_FINDINGS,
                as_json=as_json,
            )
        previous = entry
    head = entries[-1].hash if entries else None
    if as_json:
        print_json({"ok": True, "entries": len(entries), "head": head})
    else:
        console.print(f"audit entries OK: {len(entries)} of {label}, newest {head}")
