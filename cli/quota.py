"""`umbra quota show|set` and `umbra machine-types`: the team's limits on Dev CVMs (how many per
developer, each data disk's bounds, the data disk a developer and the team may hold) and the
machine-type catalog. Everyone in the team reads them; only admins set them (the Console says
so: the CLI checks no role itself)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.table import Table

from umbra.cli.auth import api_errors, api_failure, open_client, resolve_team, team_call
from umbra.cli.output import EXIT_FINDINGS, EXIT_USAGE, console, fail, print_json

if TYPE_CHECKING:  # the client and schemas load when a command runs, never for --help
    from umbra.console.schemas import TeamQuotasInfo

app = typer.Typer(
    help="The team's Dev CVM quotas: show (everyone), set (admins).", no_args_is_help=True
)
machine_types_app = typer.Typer(add_completion=False)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
TeamOption = Annotated[
    str | None, typer.Option("--team", help="Team (default: your login's team, or your only one).")
]
_NONE = "none"


def _limit(option: str, value: str | None, as_json: bool) -> tuple[bool, int | None]:
    """(given, value): a whole number, or `none` for no limit."""
    if value is None:
        return False, None
    if value.strip().lower() == _NONE:
        return True, None
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        fail(
            f"{option}: {value!r} is neither a whole number nor {_NONE!r}",
            EXIT_USAGE,
            fix=f"pass {option} N, or {option} none to remove the limit",
            as_json=as_json,
        )
    return True, number


def _refused(exc: Exception, team: str, as_json: bool) -> NoReturn:
    """A developer setting quotas is the Console's 403: say who may."""
    from umbra.console.client import ConsoleApiError

    if isinstance(exc, ConsoleApiError) and exc.status == 403:
        fail(
            f"console answered 403: {exc.detail}",
            EXIT_FINDINGS,
            fix=f"only an admin of team {team!r} sets its quotas; ask one",
            as_json=as_json,
        )
    api_failure(exc, as_json)


def _gb(value: int | None) -> str:
    return "no limit" if value is None else f"{value} GB"


def _bounds(info: TeamQuotasInfo) -> str:
    low, high = info.min_data_disk_gb, info.max_data_disk_gb
    if low is None and high is None:
        return "any size the provider accepts"
    return f"{low if low is not None else 1}-{high if high is not None else 65536} GB"


def _show(info: TeamQuotasInfo, as_json: bool) -> None:
    if as_json:
        print_json(info.model_dump(mode="json"))
        return
    use = info.usage
    table = Table(title=f"Quotas of {info.team}")
    for column in ("quota", "limit", "used"):
        table.add_column(column)
    cvms = info.max_dev_cvms_per_owner
    table.add_row(
        "Dev CVMs per developer",
        "no limit" if cvms is None else str(cvms),
        f"{use.dev_cvms} ({use.owner})" if use else "-",
    )
    table.add_row("data disk per Dev CVM", _bounds(info), "-")
    table.add_row(
        "data disk per developer",
        _gb(info.max_data_disk_gb_per_owner),
        f"{use.data_disk_gb} GB ({use.owner})" if use else "-",
    )
    table.add_row(
        "data disk of the team",
        _gb(info.max_data_disk_gb_total),
        f"{use.team_data_disk_gb} GB" if use else "-",
    )
    table.add_row("machine types", ", ".join(info.machine_types) or "any", "-")
    console.print(table)
    if info.updated_by is not None and info.updated_at is not None:
        console.print(
            f"set by {info.updated_by} at {info.updated_at:%Y-%m-%d %H:%M} UTC", highlight=False
        )


def _quotas(team: str | None, as_json: bool) -> TeamQuotasInfo:
    """The team's quotas as the Console gives them (any member may read them)."""
    return team_call(team, as_json, lambda c, t: c.quotas(t))[1]


@app.command()
def show(team: TeamOption = None, as_json: JsonFlag = False) -> None:
    """The team's quotas and what you use of them (admins and developers)."""
    info = _quotas(team, as_json)
    _show(info, as_json)


@app.command("set")
def set_(
    max_cvms_per_developer: Annotated[
        str | None,
        typer.Option(metavar="N|none", help="Dev CVMs each developer may have."),
    ] = None,
    machine_types: Annotated[
        str | None,
        typer.Option(
            metavar="A,B,…|none", help="The machine-type catalog (none: any the provider takes)."
        ),
    ] = None,
    min_data_disk_gb: Annotated[
        str | None, typer.Option(metavar="N|none", help="Smallest data disk of a Dev CVM (GB).")
    ] = None,
    max_data_disk_gb: Annotated[
        str | None, typer.Option(metavar="N|none", help="Largest data disk of a Dev CVM (GB).")
    ] = None,
    max_data_disk_gb_per_developer: Annotated[
        str | None,
        typer.Option(metavar="N|none", help="Data disk a developer's Dev CVMs may hold (GB)."),
    ] = None,
    max_data_disk_gb_total: Annotated[
        str | None,
        typer.Option(metavar="N|none", help="Data disk the team's Dev CVMs may hold (GB)."),
    ] = None,
    team: TeamOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Change some quotas (admins; audited). Limits not named keep their value."""
    from pydantic import ValidationError

    from umbra.console.schemas import TeamQuotas

    changes: dict[str, object] = {}
    for option, field, value in (
        ("--max-cvms-per-developer", "max_dev_cvms_per_owner", max_cvms_per_developer),
        ("--min-data-disk-gb", "min_data_disk_gb", min_data_disk_gb),
        ("--max-data-disk-gb", "max_data_disk_gb", max_data_disk_gb),
        (
            "--max-data-disk-gb-per-developer",
            "max_data_disk_gb_per_owner",
            max_data_disk_gb_per_developer,
        ),
        ("--max-data-disk-gb-total", "max_data_disk_gb_total", max_data_disk_gb_total),
    ):
        given, number = _limit(option, value, as_json)
        if given:
            changes[field] = number
    if machine_types is not None:
        names = [] if machine_types.strip().lower() == _NONE else machine_types.split(",")
        changes["machine_types"] = [name.strip() for name in names if name.strip()]
    if not changes:
        fail(
            "nothing to change",
            EXIT_USAGE,
            fix="pass at least one limit, e.g. --max-cvms-per-developer 2 (see --help)",
            as_json=as_json,
        )
    client, login = open_client(as_json)
    team_name = team or ""
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            current = client.quotas(team_name)
            doc = current.model_dump(include=set(TeamQuotas.model_fields)) | changes
            try:
                wanted = TeamQuotas.model_validate(doc)
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or 'quotas'}: {e['msg']}" for e in exc.errors()
                )
                fail(problems, EXIT_USAGE, as_json=as_json)
            info = client.set_quotas(team_name, wanted)
    except api_errors() as exc:
        _refused(exc, team_name, as_json)
    _show(info, as_json)


@machine_types_app.command("machine-types")
def machine_types(team: TeamOption = None, as_json: JsonFlag = False) -> None:
    """The machine types and data disk sizes Dev CVMs of the team may launch with."""
    info = _quotas(team, as_json)
    catalog = {
        "team": info.team,
        "machine_types": info.machine_types,
        "min_data_disk_gb": info.min_data_disk_gb,
        "max_data_disk_gb": info.max_data_disk_gb,
    }
    if as_json:
        print_json(catalog)
        return
    if info.machine_types:
        table = Table(title=f"Machine types of {info.team}")
        table.add_column("machine type")
        table.add_column("data disk per Dev CVM")
        for name in info.machine_types:
            table.add_row(name, _bounds(info))
        console.print(table)
        return
    console.print(
        f"{info.team} has no machine-type catalog: any machine type the provider accepts "
        f"(`umbra cvm launch --size`, else the provider's default); data disk per Dev CVM: "
        f"{_bounds(info)}",
        highlight=False,
    )
