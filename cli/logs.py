"""`umbra logs`: query the traffic log (one record per proxy decision; never values or bodies).

The default layout fits 80 columns (short CVM ids, cut paths); `--wide` shows full values and
`--json` everything. `--follow` keeps polling for newer records. `--quarantined` lists records the
Console could not store, with the reason (admins).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from umbra.cli.auth import api_errors, api_failure, open_client, resolve_team
from umbra.cli.output import EXIT_USAGE, console, fail, print_json
from umbra.contracts.traffic import Decision

if TYPE_CHECKING:  # for annotations: the client and schemas load when a command runs
    from umbra.console.schemas import QuarantinedRecord, TrafficRecordOut

# One command: the options live on the group's callback, so it is `umbra logs --cvm ...`
# (app.py's lazy loader mounts every sub-app with `typer.main.get_group`).
app = typer.Typer(help="Query the traffic log.")

_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
FOLLOW_INTERVAL = 2.0


def parse_since(text: str) -> datetime:
    """`15m`, `2h`, `7d` ago, or an ISO 8601 time (naive means UTC)."""
    match = _DURATION.match(text)
    if match:
        return datetime.now(UTC) - timedelta(**{_UNITS[match[2]]: int(match[1])})
    value = datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _time(option: str, text: str | None, as_json: bool) -> datetime | None:
    if text is None:
        return None
    try:
        return parse_since(text)
    except ValueError:
        fail(f"{option} {text!r}: use 15m, 2h, 7d or an ISO 8601 time", EXIT_USAGE, as_json=as_json)


@app.callback(invoke_without_command=True)
def logs(
    cvm: Annotated[str | None, typer.Option("--cvm", help="Only this CVM id.")] = None,
    owner: Annotated[str | None, typer.Option(help="Only this owner (admins).")] = None,
    host: Annotated[str | None, typer.Option(help="Only this destination host.")] = None,
    decision: Annotated[
        Decision | None, typer.Option(help="Only allowed or denied requests.")
    ] = None,
    reason: Annotated[str | None, typer.Option(help="Only this reason (e.g. no_rule).")] = None,
    rule: Annotated[str | None, typer.Option(help="Only this rule id.")] = None,
    since: Annotated[
        str | None, typer.Option(help="Newer than a duration (15m, 2h, 7d) or an ISO time.")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="Older than a duration ago or an ISO time.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Most records to show.")] = 100,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep showing new records.")
    ] = False,
    wide: Annotated[bool, typer.Option("--wide", help="Full ids and values.")] = False,
    quarantined: Annotated[
        bool, typer.Option("--quarantined", help="Records the Console could not store (admins).")
    ] = False,
    team: Annotated[str | None, typer.Option("--team", help="Team (default: yours).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Traffic decisions, newest first."""
    start, end = _time("--since", since, as_json), _time("--until", until, as_json)
    client, login = open_client(as_json)
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            if quarantined:
                _quarantine(client.quarantine(team_name, limit=limit).records, wide, as_json)
                return

            def page(after: datetime | None) -> list[TrafficRecordOut]:
                return client.traffic(
                    team_name,
                    cvm_id=cvm,
                    owner=owner,
                    host=host,
                    decision=decision,
                    reason=reason,
                    rule_id=rule,
                    since=after,
                    until=end,
                    limit=limit,
                ).records

            records = page(start)
            if as_json and not follow:
                print_json([record.model_dump(mode="json") for record in records])
                return
            if not follow:
                _table(records, wide)
                return
            _follow(page, records, wide, as_json)
    except api_errors() as exc:
        api_failure(exc, as_json)


def _follow(
    page: Callable[[datetime | None], list[TrafficRecordOut]],
    records: list[TrafficRecordOut],
    wide: bool,
    as_json: bool,
) -> None:
    """Oldest first, one line (or JSON object) per record, until interrupted."""
    seen: set[str] = set()
    newest: datetime | None = None
    batch = records
    try:
        while True:
            for record in reversed(batch):
                if record.id in seen:
                    continue
                seen.add(record.id)
                newest = record.time if newest is None else max(newest, record.time)
                if as_json:
                    print_json(record.model_dump(mode="json"))
                else:
                    console.print(_line(record, wide), highlight=False, soft_wrap=wide)
            time.sleep(FOLLOW_INTERVAL)
            batch = page(newest)
    except KeyboardInterrupt:
        return


def _short(cvm_id: str | None, wide: bool) -> str:
    if cvm_id is None:
        return "-"
    return cvm_id if wide else "…" + cvm_id[-6:]


def _cut(text: str, width: int, wide: bool) -> str:
    return text if wide or len(text) <= width else text[: width - 1] + "…"


def _line(r: TrafficRecordOut, wide: bool) -> str:
    colour = "green" if r.decision == Decision.ALLOW else "red"
    when = r.time.isoformat(timespec="seconds") if wide else r.time.strftime("%H:%M:%S")
    target = (r.host or r.connect_host or r.sni or "-") + (r.path or "")
    return (
        f"{when} {_short(r.cvm_id, wide)} [{colour}]{r.decision:5}[/] {r.method or r.kind:7} "
        f"{_cut(target, 38, wide)} {r.reason or r.rule_id or ''}"
    ) + (f" status={r.status} truncated={','.join(r.truncated)}" if wide else "")


# Narrow layout: fixed widths that sum to 80 with one space between columns.
_NARROW = (
    ("time", 8),
    ("cvm", 7),
    ("act", 5),
    ("method", 6),
    ("host", 20),
    ("path", 17),
    ("reason", 10),
)


def _table(records: list[TrafficRecordOut], wide: bool) -> None:
    if wide:  # one unwrapped line per record, every value in full
        for record in records:
            console.print(_line(record, wide=True), highlight=False, soft_wrap=True)
        return
    table = Table(
        title=f"{len(records)} traffic record(s), newest first",
        box=None,
        pad_edge=False,
        padding=(0, 1, 0, 0),
    )
    for column, width in _NARROW:
        table.add_column(column, width=width, no_wrap=True, overflow="ellipsis")
    for r in records:
        colour = "green" if r.decision == Decision.ALLOW else "red"
        suffix = " ✂" if r.truncated else ""  # a value was cut to fit the record schema
        table.add_row(
            r.time.strftime("%H:%M:%S"),
            _short(r.cvm_id, wide),
            f"[{colour}]{r.decision}[/]",
            r.method or r.kind,
            r.host or r.connect_host or r.sni or "-",
            (r.path or "-") + suffix,
            r.reason or r.rule_id or "-",
        )
    console.print(table)


def _quarantine(records: list[QuarantinedRecord], wide: bool, as_json: bool) -> None:
    if as_json:
        print_json([record.model_dump(mode="json") for record in records])
        return
    table = Table(title=f"{len(records)} quarantined record(s), newest first", box=None)
    for column in ("received", "record", "reason", "detail"):
        table.add_column(column, overflow="fold" if wide else "ellipsis", no_wrap=not wide)
    for r in records:
        table.add_row(
            r.received_at.strftime("%m-%d %H:%M:%S"),
            _cut(r.record_id or "-", 12, wide),
            r.reason,
            _cut(r.detail, 40, wide),
        )
    console.print(table)
