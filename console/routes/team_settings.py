"""Team settings an admin manages: the default profiles attached to every Dev CVM at launch."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header

from umbra.console import team_defaults
from umbra.console.deps import ConsoleDep, UserDep, require_role
from umbra.console.routes.common import TeamPath
from umbra.console.schemas import ProfilesUpdate, TeamDefaultProfiles

router = APIRouter(prefix="/api/v1/teams/{team}", tags=["profiles"])


@router.get(
    "/default-profiles",
    summary="The profiles attached to every Dev CVM launched in the team (admin).",
)
def get_default_profiles(team: TeamPath, console: ConsoleDep, user: UserDep) -> TeamDefaultProfiles:
    require_role(user, team, "admin")
    return team_defaults.get(console, team)


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
    require_role(user, team, "admin")
    return team_defaults.put(console, user, team, body.profiles, if_match)
