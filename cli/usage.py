"""`umbra usage`: LLM token usage the proxy read from API responses, per UTC day, developer, CVM
and model (admins: the team; developers: their own). `--json` for scripts."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from umbra.cli.auth import team_call
from umbra.cli.logs import _time
from umbra.cli.output import console, print_json

# One command: the options live on the group's callback (`umbra usage --since 7d`).
app = typer.Typer(help="LLM token usage per day, developer, CVM and model.")


@app.callback(invoke_without_command=True)
def usage(
    since: Annotated[
        str | None, typer.Option(help="Newer than a duration (2h, 7d) or an ISO time; default 30d.")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="Older than a duration ago or an ISO time.")
    ] = None,
    owner: Annotated[str | None, typer.Option(help="Only this developer (admins).")] = None,
    cvm: Annotated[str | None, typer.Option("--cvm", help="Only this CVM id.")] = None,
    team: Annotated[str | None, typer.Option("--team", help="Team (default: yours).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """LLM token usage, summed per UTC day, developer, CVM and model."""
    start, end = _time("--since", since, as_json), _time("--until", until, as_json)
    _, report = team_call(
        team,
        as_json,
        lambda c, t: c.usage(t, since=start, until=end, owner=owner, cvm_id=cvm),
    )
    if as_json:
        print_json(report.model_dump(mode="json"))
        return
    table = Table(
        title=f"LLM usage, {report.since:%Y-%m-%d %H:%M} to {report.until:%Y-%m-%d %H:%M} UTC"
    )
    for column in (
        "day",
        "developer",
        "cvm",
        "model",
        "requests",
        "input",
        "output",
        "cache read",
        "cache write",
    ):
        table.add_column(
            column,
            justify="right"
            if column in ("requests", "input", "output", "cache read", "cache write")
            else "left",
        )
    for row in report.rows:
        table.add_row(
            row.day.isoformat(), row.owner or "-", row.cvm_id or "-", row.model,
            f"{row.requests:,}", f"{row.input_tokens:,}", f"{row.output_tokens:,}",
            f"{row.cache_read_tokens:,}", f"{row.cache_write_tokens:,}",
        )  # fmt: skip
    totals = report.totals
    table.add_row(
        "total", "", "", "", f"{totals['requests']:,}", f"{totals['input_tokens']:,}",
        f"{totals['output_tokens']:,}", f"{totals['cache_read_tokens']:,}",
        f"{totals['cache_write_tokens']:,}", style="bold",
    )  # fmt: skip
    console.print(table)
