"""`umbra logs`: query the traffic log (one record per proxy decision; never values or bodies)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

import httpx
import typer
from rich.table import Table

from umbra.cli.auth import api_failure, open_client, resolve_team
from umbra.cli.output import EXIT_USAGE, console, fail, print_json
from umbra.console.client import ConsoleApiError
from umbra.console.schemas import TrafficRecordOut

# One command: the options live on the group's callback, so it is `umbra logs --cvm ...`
# (app.py's lazy loader mounts every sub-app with `typer.main.get_group`).
app = typer.Typer(help="Query the traffic log.")

_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_since(text: str) -> datetime:
    """`15m`, `2h`, `7d` ago, or an ISO 8601 time (naive means UTC)."""
    match = _DURATION.match(text)
    if match:
        return datetime.now(UTC) - timedelta(**{_UNITS[match[2]]: int(match[1])})
    value = datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


@app.callback(invoke_without_command=True)
def logs(
    cvm: Annotated[str | None, typer.Option("--cvm", help="Only this CVM id.")] = None,
    host: Annotated[str | None, typer.Option(help="Only this destination host.")] = None,
    decision: Annotated[
        Literal["allow", "deny"] | None, typer.Option(help="Only allowed or denied requests.")
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="Newer than a duration (15m, 2h, 7d) or an ISO time.")
    ] = None,
    owner: Annotated[str | None, typer.Option(help="Only this owner (admins).")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Most records to show.")] = 100,
    team: Annotated[str | None, typer.Option("--team", help="Team (default: yours).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Traffic decisions, newest first."""
    try:
        start = parse_since(since) if since else None
    except ValueError:
        fail(f"--since {since!r}: use 15m, 2h, 7d or an ISO 8601 time", EXIT_USAGE, as_json=as_json)
    client, login = open_client(as_json)
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            page = client.traffic(
                team_name,
                cvm_id=cvm,
                owner=owner,
                host=host,
                decision=decision,
                since=start,
                limit=limit,
            )
    except (ConsoleApiError, httpx.HTTPError) as exc:
        api_failure(exc, as_json)
    if as_json:
        print_json([record.model_dump(mode="json") for record in page.records])
        return
    _table(page.records)


def _table(records: list[TrafficRecordOut]) -> None:
    table = Table(title=f"{len(records)} traffic record(s), newest first")
    for column in ("time", "cvm", "method", "host", "path", "decision", "rule / reason", "status"):
        table.add_column(column, overflow="fold")
    for r in records:
        colour = "green" if r.decision == "allow" else "red"
        table.add_row(
            r.time.isoformat(timespec="seconds"),
            r.cvm_id or "-",
            r.method or r.kind,
            r.host or r.connect_host or r.sni or "-",
            r.path or "-",
            f"[{colour}]{r.decision}[/]",
            " ".join(x for x in (r.rule_id, r.reason) if x) or "-",
            str(r.status) if r.status is not None else "-",
        )
    console.print(table)
