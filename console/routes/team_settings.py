"""Team settings an admin manages: the default profiles attached to every Dev CVM at launch."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header

from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.routes.common import TeamPath
from umbra.console.schemas import ProfilesUpdate, TeamDefaultProfiles
from umbra.console.services import team_defaults

router = APIRouter(prefix="/api/v1/teams/{team}", tags=["profiles"])


@router.get(
    "/default-profiles",
    summary="The profiles attached to every Dev CVM launched in the team (admin).",
)
def get_default_profiles(team: TeamPath, console: ConsoleDep, user: UserDep) -> TeamDefaultProfiles:
    return team_defaults.get(console=console, user=user, team=team)


@router.put(
    "/default-profiles",
    summary="Set the team's default profiles (admin); they must compose in the current bundle.",
)
def put_default_profiles(
    team: TeamPath,
    body: ProfilesUpdate,
    console: ConsoleDep,
    user: UserDep,
    if_match: Annotated[
        str | None,
        Header(
            alias="If-Match",
            max_length=128,
            description="Set only if the defaults are still this version (`etag`; else 412).",
        ),
    ] = None,
) -> TeamDefaultProfiles:
    return team_defaults.put(
        console=console, user=user, team=team, profiles=body.profiles, if_match=if_match
    )
