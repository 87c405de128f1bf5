"""`umbra profile`: which policy profiles the team's bundle offers, and which a Dev CVM has (admins
attach and detach; the Console checks that the result composes before it commits)."""

from __future__ import annotations

from typing import Annotated

import httpx
import typer
from rich.table import Table

from umbra.cli.auth import api_failure, open_client, resolve_team
from umbra.cli.output import console, print_json
from umbra.console.client import ConsoleApiError
from umbra.console.schemas import CvmInfo, profiles_etag

app = typer.Typer(help="Attach policy profiles to Dev CVMs (admins).", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
TeamOption = Annotated[str | None, typer.Option("--team", help="Team (default: yours).")]
CvmArg = Annotated[str, typer.Argument(help="Dev CVM id.")]
ProfilesArg = Annotated[list[str], typer.Argument(help="Profile names.")]


@app.command("list")
def list_profiles(team: TeamOption = None, as_json: JsonFlag = False) -> None:
    """The current bundle's profiles and each Dev CVM's attachments."""
    client, login = open_client(as_json)
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            bundles = client.list_bundles(team_name)
            cvms = [cvm for cvm in client.list_cvms(team_name) if cvm.kind == "dev"]
    except (ConsoleApiError, httpx.HTTPError) as exc:
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
    client, _login = open_client(as_json)
    try:
        with client:
            current = client.get_cvm(cvm_id)
            wanted = sorted((set(current.profiles) | set(add)) - set(remove))
            # If another admin changed them meanwhile the Console answers 412: nothing is lost.
            return client.attach_profiles(cvm_id, wanted, if_match=profiles_etag(current.profiles))
    except (ConsoleApiError, httpx.HTTPError) as exc:
        api_failure(exc, as_json)


def _show(cvm: CvmInfo, as_json: bool) -> None:
    if as_json:
        print_json({"cvm": cvm.id, "profiles": cvm.profiles})
    else:
        console.print(f"{cvm.id} ({cvm.name}): {', '.join(cvm.profiles) or 'no profiles'}")


@app.command()
def attach(cvm: CvmArg, profiles: ProfilesArg, as_json: JsonFlag = False) -> None:
    """Add profiles to a Dev CVM's attachments."""
    _show(_change(cvm, profiles, [], as_json), as_json)


@app.command()
def detach(cvm: CvmArg, profiles: ProfilesArg, as_json: JsonFlag = False) -> None:
    """Remove profiles from a Dev CVM's attachments."""
    _show(_change(cvm, [], profiles, as_json), as_json)
