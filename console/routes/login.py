"""What a CLI needs to log in: the OIDC issuer the Console trusts (public, unauthenticated)."""

from __future__ import annotations

from fastapi import APIRouter

from umbra.console.deps import ConsoleDep
from umbra.contracts.model import Strict

router = APIRouter(prefix="/api/v1", tags=["identity"])
CLI_CLIENT_ID = "umbra-cli"


class LoginInfo(Strict):
    issuer: str | None
    audience: str
    client_id: str


@router.get("/auth/oidc", summary="The OIDC issuer and CLI client id to log in with.")
def oidc_info(console: ConsoleDep) -> LoginInfo:
    settings = console.settings
    return LoginInfo(
        issuer=settings.oidc_issuer, audience=settings.oidc_audience, client_id=CLI_CLIENT_ID
    )
