"""Authentication and authorization dependencies shared by the routes.

Users authenticate with OIDC bearer tokens; their roles come from the token's roles claim as
`TEAM:ROLE` entries (the identity provider is the source of truth for membership). Security CVMs
authenticate with the credential issued when they were registered (stored only as a SHA-256).
"""

from __future__ import annotations

import logging
import re
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from sqlmodel import col

from umbra.console.enums import CvmKind, CvmState, Role
from umbra.console.models import Cvm
from umbra.console.oidc import IssuerUnavailable, TokenError
from umbra.console.services.access import CREDENTIAL_PREFIX, User, credential_hash
from umbra.console.services.people import active_roles
from umbra.console.state import Console

log = logging.getLogger(__name__)

_ROLE_ENTRY = re.compile(r"^([a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?):(admin|developer)$")

user_bearer = HTTPBearer(
    auto_error=False, scheme_name="oidc", description="An OIDC access token from the issuer."
)
cvm_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="security_cvm",
    description="The credential issued when the Security CVM was registered.",
)


def get_console(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


ConsoleDep = Annotated[Console, Depends(get_console)]


def parse_roles(value: object) -> dict[str, Role]:
    roles: dict[str, Role] = {}
    if not isinstance(value, list):
        return roles
    for item in value:
        if not isinstance(item, str):
            continue
        match = _ROLE_ENTRY.fullmatch(item)  # exact: '$' alone accepts a trailing newline
        if match is None:
            continue
        team, role = match.group(1), Role(match.group(2))
        if role == Role.admin or team not in roles:
            roles[team] = role
    return roles


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": "Bearer"}
    )


def current_user(
    console: ConsoleDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(user_bearer)],
) -> User:
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise _unauthorized("missing bearer token")
    if console.oidc is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "OIDC is not configured")
    try:
        claims = console.oidc.validate(credentials.credentials)
    except TokenError as exc:
        raise _unauthorized(str(exc)) from None
    except IssuerUnavailable as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc)) from None
    roles = parse_roles(claims.claims.get(console.settings.oidc_roles_claim))
    # A deactivated developer's token still validates; it carries no role in that team.
    return User(subject=claims.subject, roles=active_roles(console, claims.subject, roles))


UserDep = Annotated[User, Depends(current_user)]


def current_security_cvm(
    console: ConsoleDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(cvm_bearer)],
) -> Cvm:
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise _unauthorized("missing bearer token")
    token = credentials.credentials
    if not token.startswith(CREDENTIAL_PREFIX) or len(token) > 128:
        raise _unauthorized("not a Security CVM credential")
    with console.session() as session:
        cvm = session.execute(
            select(Cvm).where(col(Cvm.credential_hash) == credential_hash(token))
        ).scalar_one_or_none()
    if cvm is None or cvm.kind != CvmKind.security or cvm.state == CvmState.destroyed:
        raise _unauthorized("unknown or revoked Security CVM credential")
    return cvm


SecurityCvmDep = Annotated[Cvm, Depends(current_security_cvm)]


def require_same_cvm(caller: Cvm, cvm_id: str) -> None:
    if caller.id != cvm_id:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, "this credential belongs to a different Security CVM"
        )
