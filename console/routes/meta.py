"""Health, readiness, metrics and the caller's identity."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from umbra.console.db import not_ready
from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.schemas import Me

router = APIRouter()


@router.get("/healthz", tags=["meta"], summary="Liveness: the process answers.")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    tags=["meta"],
    summary="Readiness: the database answers and is migrated to this build's head.",
    responses={503: {"description": "Not ready"}},
)
def readyz(console: ConsoleDep, response: Response) -> dict[str, str]:
    reason = not_ready(console.engine)
    if reason is not None:
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return {"status": reason}
    return {"status": "ready"}


@router.get("/metrics", tags=["meta"], summary="Prometheus metrics.")
def metrics(console: ConsoleDep) -> Response:
    return Response(generate_latest(console.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/api/v1/me", tags=["identity"], summary="Who the bearer token says you are.")
def me(user: UserDep) -> Me:
    return Me(subject=user.subject, roles=dict(user.roles))
