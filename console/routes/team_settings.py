"""Team settings an admin manages: the default profiles attached to every Dev CVM at launch."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header

from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.routes.common import TeamPath
from umbra.console.schemas import ProfilesUpdate, TeamDefaultProfiles, TeamQuotas, TeamQuotasInfo
from umbra.console.services import team_defaults, team_quotas

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


@router.get("/quotas", summary="The team's Dev CVM quotas (admins and developers).")
def get_quotas(team: TeamPath, console: ConsoleDep, user: UserDep) -> TeamQuotasInfo:
    return team_quotas.get(console=console, user=user, team=team)


@router.put(
    "/quotas",
    summary="Set Dev CVMs per developer and the machine-type catalog (admin; audited).",
)
def put_quotas(
    team: TeamPath, body: TeamQuotas, console: ConsoleDep, user: UserDep
) -> TeamQuotasInfo:
    return team_quotas.put(console=console, user=user, team=team, quotas=body)
