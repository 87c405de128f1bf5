"""`umbra profile`: which policy profiles the team's bundle offers, and which a Dev CVM has (admins
attach and detach; the Console checks that the result composes before it commits).

With `--team-default` the same commands read and change the team's default profiles, which the
Console attaches to every Dev CVM launched from then on (any provider)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from umbra.cli.auth import api_errors, api_failure, open_client, resolve_team
from umbra.cli.output import EXIT_USAGE, console, fail, print_json
from umbra.console.enums import CvmKind

if TYPE_CHECKING:  # for annotations: the client and schemas load when a command runs
    from umbra.console.schemas import CvmInfo, TeamDefaultProfiles

app = typer.Typer(
    help="Attach policy profiles to Dev CVMs and set team defaults (admins).",
    no_args_is_help=True,
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
TeamOption = Annotated[str | None, typer.Option("--team", help="Team (default: yours).")]
TargetsArg = Annotated[
    list[str],
    typer.Argument(
        metavar="[CVM] PROFILE...",
        help="Dev CVM id then profile names (only profiles with --team-default).",
    ),
]
TeamDefaultFlag = Annotated[
    bool,
    typer.Option(
        "--team-default", help="The team's default profiles, attached to every new Dev CVM."
    ),
]


@app.command("list")
def list_profiles(
    team: TeamOption = None, team_default: TeamDefaultFlag = False, as_json: JsonFlag = False
) -> None:
    """The current bundle's profiles and each Dev CVM's attachments (or the team defaults)."""
    if team_default:
        _show_defaults(_defaults(team, [], [], as_json, change=False), as_json)
        return
    client, login = open_client(as_json)
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            bundles = client.list_bundles(team_name)
            cvms = [cvm for cvm in client.list_cvms(team_name) if cvm.kind == CvmKind.dev]
    except api_errors() as exc:
        api_failure(exc, as_json)
    offered = bundles[0].profiles if bundles else []
    if as_json:
        print_json(
            {
                "team": team_name,
                "serial": bundles[0].serial if bundles else None,
                "profiles": offered,
                "cvms": {cvm.id: cvm.profiles for cvm in cvms},
            }
        )
        return
    if bundles:
        console.print(f"bundle serial {bundles[0].serial}: {', '.join(offered) or '(none)'}")
    else:
        console.print("no policy bundle yet: `umbra policy publish BUNDLE`")
    table = Table(title=f"profiles attached in {team_name}")
    for column in ("cvm", "name", "owner", "profiles"):
        table.add_column(column, overflow="fold")
    for cvm in cvms:
        table.add_row(cvm.id, cvm.name, cvm.owner, ", ".join(cvm.profiles) or "-")
    console.print(table)


def _change(cvm_id: str, add: list[str], remove: list[str], as_json: bool) -> CvmInfo:
    from umbra.console.schemas import profiles_etag

    client, _login = open_client(as_json)
    try:
        with client:
            current = client.get_cvm(cvm_id)
            wanted = sorted((set(current.profiles) | set(add)) - set(remove))
            # If another admin changed them meanwhile the Console answers 412: nothing is lost.
            return client.attach_profiles(cvm_id, wanted, if_match=profiles_etag(current.profiles))
    except api_errors() as exc:
        api_failure(exc, as_json)


def _defaults(
    team: str | None, add: list[str], remove: list[str], as_json: bool, *, change: bool = True
) -> TeamDefaultProfiles:
    client, login = open_client(as_json)
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            current = client.default_profiles(team_name)
            if not change:
                return current
            wanted = sorted((set(current.profiles) | set(add)) - set(remove))
            return client.set_default_profiles(team_name, wanted, if_match=current.etag)
    except api_errors() as exc:
        api_failure(exc, as_json)


def _show(cvm: CvmInfo, as_json: bool) -> None:
    if as_json:
        print_json({"cvm": cvm.id, "profiles": cvm.profiles})
    else:
        console.print(f"{cvm.id} ({cvm.name}): {', '.join(cvm.profiles) or 'no profiles'}")


def _show_defaults(defaults: TeamDefaultProfiles, as_json: bool) -> None:
    if as_json:
        print_json({"team": defaults.team, "team_default": True, "profiles": defaults.profiles})
    else:
        console.print(
            f"team {defaults.team} default profiles (attached to every new Dev CVM): "
            f"{', '.join(defaults.profiles) or 'none'}"
        )


def _apply(
    targets: list[str], team: str | None, team_default: bool, adding: bool, as_json: bool
) -> None:
    if team_default:
        add, remove = (targets, []) if adding else ([], targets)
        _show_defaults(_defaults(team, add, remove, as_json), as_json)
        return
    if team is not None:
        fail("--team applies to --team-default only (a CVM id names its team)", EXIT_USAGE,
             as_json=as_json)  # fmt: skip
    if len(targets) < 2:
        fail("pass a Dev CVM id and at least one profile (or --team-default)", EXIT_USAGE,
             as_json=as_json)  # fmt: skip
    cvm_id, profiles = targets[0], targets[1:]
    add, remove = (profiles, []) if adding else ([], profiles)
    _show(_change(cvm_id, add, remove, as_json), as_json)


@app.command()
def attach(
    targets: TargetsArg,
    team_default: TeamDefaultFlag = False,
    team: TeamOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Add profiles to a Dev CVM's attachments, or to the team defaults."""
    _apply(targets, team, team_default, True, as_json)


@app.command()
def detach(
    targets: TargetsArg,
    team_default: TeamDefaultFlag = False,
    team: TeamOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Remove profiles from a Dev CVM's attachments, or from the team defaults."""
    _apply(targets, team, team_default, False, as_json)
