"""`umbra user`: people in a team (admins). `deactivate SUBJECT`: no role in the team from the
next request on, personal secrets erased, their Dev CVMs detached and stopped (audited).
`reactivate SUBJECT`: their roles count again; what deactivation erased or detached stays so."""

from __future__ import annotations

from typing import Annotated

import typer

from umbra.cli.auth import team_call
from umbra.cli.output import console, print_json

app = typer.Typer(
    help="People in a team: deactivate or reactivate a developer (admins).", no_args_is_help=True
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
TeamOption = Annotated[str | None, typer.Option("--team", help="Team (default: yours).")]


@app.command()
def deactivate(
    subject: Annotated[str, typer.Argument(help="The developer's OIDC subject (`sub`).")],
    team: TeamOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Deactivate a developer: sessions refused, personal secrets erased, CVMs detached and stopped."""
    team_name, done = team_call(team, as_json, lambda c, t: c.deactivate_user(t, subject))
    if as_json:
        print_json(done.model_dump(mode="json"))
        return
    state = "deactivated" if done.newly else "was already deactivated"
    console.print(
        f"{subject} {state} in {team_name}: {done.secrets_erased} personal secrets erased"
    )
    for label, ids in (("detached", done.cvms_detached), ("stopped", done.cvms_stopped)):
        if ids:
            console.print(f"  {label}: {', '.join(ids)}")
    for cvm_id, reason in done.cvms_skipped.items():
        console.print(f"  [yellow]left as is[/]: {cvm_id} ({reason}); run this again later")


@app.command()
def reactivate(
    subject: Annotated[str, typer.Argument(help="The developer's OIDC subject (`sub`).")],
    team: TeamOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Reactivate a developer: their roles count again (secrets stay erased, CVMs detached)."""
    team_name, done = team_call(team, as_json, lambda c, t: c.reactivate_user(t, subject))
    if as_json:
        print_json(done.model_dump(mode="json"))
        return
    if not done.newly:
        console.print(f"{subject} was not deactivated in {team_name}: nothing changed")
        return
    console.print(
        f"{subject} reactivated in {team_name} (deactivated by {done.deactivated_by}); "
        "personal secrets set again by them, profiles attached again by an admin"
    )
