"""Write-only secrets. Values go in; only metadata ever comes out (`services/secrets.py`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Response, status

from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.enums import Scope
from umbra.console.routes.common import TeamPath
from umbra.console.schemas import (
    SECRET_NAME_PATTERN,
    PersonalSecretSet,
    SecretInfo,
    TeamSecretSet,
)
from umbra.console.services import secrets

router = APIRouter(prefix="/api/v1/teams/{team}", tags=["secrets"])
SecretName = Annotated[str, Path(pattern=SECRET_NAME_PATTERN, description="Secret name.")]
IfMatch = Annotated[
    str | None,
    Header(
        alias="If-Match",
        max_length=32,
        description='Set only if the secret exists at this version, e.g. "3" (else 412): a '
        "rotation that does not overwrite a concurrent one.",
    ),
]


@router.put("/secrets/{name}", summary="Set a team secret (admin). The value is never returned.")
def set_team_secret(
    team: TeamPath,
    name: SecretName,
    body: TeamSecretSet,
    console: ConsoleDep,
    user: UserDep,
    if_match: IfMatch = None,
) -> SecretInfo:
    return secrets.set_secret(
        console=console, user=user, team=team, scope=Scope.team, name=name,
        value=body.value, hosts=body.hosts, if_match=if_match, kind=body.kind,
    )  # fmt: skip


@router.get("/secrets", summary="List team secrets, metadata only (admin, developer).")
def list_team_secrets(team: TeamPath, console: ConsoleDep, user: UserDep) -> list[SecretInfo]:
    return secrets.list_secrets(console=console, user=user, team=team, scope=Scope.team)


@router.delete(
    "/secrets/{name}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete a team secret (admin).",
)
def delete_team_secret(
    team: TeamPath, name: SecretName, console: ConsoleDep, user: UserDep
) -> Response:
    secrets.delete_secret(console=console, user=user, team=team, scope=Scope.team, name=name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.put(
    "/personal-secrets/{name}",
    summary="Set your personal secret, bound to hosts. The value is never returned.",
)
def set_personal_secret(
    team: TeamPath,
    name: SecretName,
    body: PersonalSecretSet,
    console: ConsoleDep,
    user: UserDep,
    if_match: IfMatch = None,
) -> SecretInfo:
    return secrets.set_secret(
        console=console, user=user, team=team, scope=Scope.personal, name=name,
        value=body.value, hosts=body.hosts, if_match=if_match, kind=body.kind,
    )  # fmt: skip


@router.get("/personal-secrets", summary="List your personal secrets, metadata only.")
def list_personal_secrets(team: TeamPath, console: ConsoleDep, user: UserDep) -> list[SecretInfo]:
    return secrets.list_secrets(console=console, user=user, team=team, scope=Scope.personal)


@router.delete(
    "/personal-secrets/{name}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete your personal secret.",
)
def delete_personal_secret(
    team: TeamPath, name: SecretName, console: ConsoleDep, user: UserDep
) -> Response:
    secrets.delete_secret(console=console, user=user, team=team, scope=Scope.personal, name=name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
