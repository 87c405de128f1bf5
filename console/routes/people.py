"""People: deactivate or reactivate a developer in a team (admin); the work is
services/people.py."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Path

from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.routes.common import TeamPath
from umbra.console.schemas import Deactivated, Reactivated
from umbra.console.services import people

router = APIRouter(prefix="/api/v1/teams/{team}/members", tags=["people"])

SubjectPath = Annotated[
    str, Path(min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$", description="OIDC `sub`.")
]


@router.post(
    "/{subject}/deactivate",
    summary="Deactivate a developer: no role in the team, personal secrets erased, CVMs "
    "detached and stopped (admin; audited).",
)
def deactivate(
    team: TeamPath, subject: SubjectPath, console: ConsoleDep, user: UserDep
) -> Deactivated:
    done = people.deactivate(console=console, user=user, team=team, subject=subject)
    return Deactivated.model_validate(asdict(done))


@router.post(
    "/{subject}/reactivate",
    summary="Reactivate a developer: their roles in the team count again; erased secrets stay "
    "erased, CVMs stay detached (admin; audited; idempotent).",
)
def reactivate(
    team: TeamPath, subject: SubjectPath, console: ConsoleDep, user: UserDep
) -> Reactivated:
    done = people.reactivate(console=console, user=user, team=team, subject=subject)
    return Reactivated.model_validate(asdict(done))
