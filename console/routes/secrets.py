"""Write-only secrets. Values go in; only metadata ever comes out."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, HTTPException, Path, Response, status
from sqlalchemy import select
from sqlmodel import col

from umbra.console import audit
from umbra.console.deps import ConsoleDep, User, UserDep, require_role
from umbra.console.envelope import seal, secret_aad
from umbra.console.models import Secret, utcnow
from umbra.console.routes.common import TeamPath, not_found
from umbra.console.schemas import (
    SECRET_NAME_PATTERN,
    PersonalSecretSet,
    SecretInfo,
    TeamSecretSet,
)
from umbra.console.state import Console

router = APIRouter(prefix="/api/v1/teams/{team}", tags=["secrets"])
SecretName = Annotated[str, Path(pattern=SECRET_NAME_PATTERN, description="Secret name.")]
Scope = Literal["team", "personal"]
IfMatch = Annotated[
    str | None,
    Header(
        alias="If-Match",
        max_length=32,
        description='Set only if the secret exists at this version, e.g. "3" (else 412): a '
        "rotation that does not overwrite a concurrent one.",
    ),
]


def expected_version(if_match: str | None) -> int | None:
    if if_match is None:
        return None
    tag = if_match.strip().removeprefix("W/").strip('"')
    if not tag.isascii() or not tag.isdigit() or len(tag) > 18:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            'If-Match: expected a secret version such as "3"',
        )
    return int(tag)


def secret_lock(team: str, scope: str, owner: str, name: str) -> str:
    """Concurrent sets of one secret (even the first) run one after the other: no lost version
    bumps, no unique violation."""
    return f"secret:{team}:{scope}:{owner}:{name}"


def secret_info(row: Secret) -> SecretInfo:
    scope: Scope = "personal" if row.scope == "personal" else "team"
    return SecretInfo(
        team=row.team,
        scope=scope,
        owner=row.owner or None,
        name=row.name,
        ref=f"{scope}/{row.name}",
        hosts=list(row.hosts),
        version=row.version,
        updated_by=row.updated_by,
        updated_at=row.updated_at,
    )


def _set(
    console: Console,
    user: User,
    team: str,
    scope: Scope,
    owner: str,
    name: str,
    value: str,
    hosts: list[str],
    expected: int | None = None,
) -> SecretInfo:
    if console.keyring is None:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, "no key encryption key is configured"
        )
    hosts = sorted(set(hosts))
    with console.write(secret_lock(team, scope, owner, name)) as session:
        row = session.execute(
            select(Secret).where(
                col(Secret.team) == team,
                col(Secret.scope) == scope,
                col(Secret.owner) == owner,
                col(Secret.name) == name,
            )
        ).scalar_one_or_none()
        if expected is not None and (row is None or row.version != expected):
            # Read under the secret's lock: of concurrent rotations from one version, exactly one
            # commits and the rest get 412.
            now = "does not exist" if row is None else f"is at version {row.version}"
            raise HTTPException(
                status.HTTP_412_PRECONDITION_FAILED,
                f"secret {scope}/{name} {now}, not version {expected}; nothing was changed",
            )
        version = 1 if row is None else row.version + 1
        sealed = seal(
            console.keyring, value.encode(), secret_aad(team, scope, owner, name, version)
        )
        if row is None:
            row = Secret(
                team=team,
                scope=scope,
                owner=owner,
                name=name,
                kek_id="",
                wrapped_key=b"",
                ciphertext=b"",
                updated_by=user.subject,
            )
        row.version = version
        row.hosts = hosts
        row.kek_id = sealed.kek_id
        row.wrapped_key = sealed.wrapped_key
        row.ciphertext = sealed.ciphertext
        row.updated_by = user.subject
        row.updated_at = utcnow()
        session.add(row)
        audit.append(
            session,
            actor=user.subject,
            team=team,
            action="secret.set",
            target=f"{scope}/{name}",
            details={"owner": owner or None, "hosts": hosts, "version": version},
        )
        session.flush()
        info = secret_info(row)
    console.metrics.audit_entries.inc()
    console.notifier.notify()  # Security CVMs long-polling the secrets version wake now
    return info


def _list(console: Console, team: str, scope: Scope, owner: str | None) -> list[SecretInfo]:
    query = select(Secret).where(col(Secret.team) == team, col(Secret.scope) == scope)
    if owner is not None:
        query = query.where(col(Secret.owner) == owner)
    with console.session() as session:
        rows = session.execute(query.order_by(col(Secret.owner), col(Secret.name))).scalars()
        return [secret_info(row) for row in rows]


def _delete(console: Console, user: User, team: str, scope: Scope, owner: str, name: str) -> None:
    with console.write(secret_lock(team, scope, owner, name)) as session:
        row = session.execute(
            select(Secret).where(
                col(Secret.team) == team,
                col(Secret.scope) == scope,
                col(Secret.owner) == owner,
                col(Secret.name) == name,
            )
        ).scalar_one_or_none()
        if row is None:
            raise not_found(f"secret {scope}/{name}")
        session.delete(row)
        audit.append(
            session,
            actor=user.subject,
            team=team,
            action="secret.delete",
            target=f"{scope}/{name}",
            details={"owner": owner or None},
        )
    console.notifier.notify()


@router.put("/secrets/{name}", summary="Set a team secret (admin). The value is never returned.")
def set_team_secret(
    team: TeamPath,
    name: SecretName,
    body: TeamSecretSet,
    console: ConsoleDep,
    user: UserDep,
    if_match: IfMatch = None,
) -> SecretInfo:
    require_role(user, team, "admin")
    expected = expected_version(if_match)
    return _set(console, user, team, "team", "", name, body.value, body.hosts, expected)


@router.get("/secrets", summary="List team secrets, metadata only (admin, developer).")
def list_team_secrets(team: TeamPath, console: ConsoleDep, user: UserDep) -> list[SecretInfo]:
    require_role(user, team, "admin", "developer")
    return _list(console, team, "team", None)


@router.delete(
    "/secrets/{name}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete a team secret (admin).",
)
def delete_team_secret(
    team: TeamPath, name: SecretName, console: ConsoleDep, user: UserDep
) -> Response:
    require_role(user, team, "admin")
    _delete(console, user, team, "team", "", name)
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
    require_role(user, team, "admin", "developer")
    expected = expected_version(if_match)
    return _set(
        console, user, team, "personal", user.subject, name, body.value, body.hosts, expected
    )


@router.get("/personal-secrets", summary="List your personal secrets, metadata only.")
def list_personal_secrets(team: TeamPath, console: ConsoleDep, user: UserDep) -> list[SecretInfo]:
    require_role(user, team, "admin", "developer")
    return _list(console, team, "personal", user.subject)


@router.delete(
    "/personal-secrets/{name}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete your personal secret.",
)
def delete_personal_secret(
    team: TeamPath, name: SecretName, console: ConsoleDep, user: UserDep
) -> Response:
    require_role(user, team, "admin", "developer")
    _delete(console, user, team, "personal", user.subject, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
