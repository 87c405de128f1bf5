"""A Security CVM writes back a rotated refresh token (`services/secret_refresh.py`): lease,
commit under the lease, or report the token endpoint's refusal. Only with the Security CVM's own
credential (issued after attestation), only for secrets a release to it carries."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from starlette.concurrency import run_in_threadpool

from umbra.console.deps import ConsoleDep, SecurityCvmDep, require_same_cvm
from umbra.console.routes.common import CvmIdPath
from umbra.console.services import secret_refresh
from umbra.contracts.secret_refresh import (
    LeaseGrant,
    RefreshCommit,
    RefreshCommitted,
    RefreshFailure,
    SecretAt,
)

router = APIRouter(prefix="/api/v1/security-cvms/{cvm_id}/secret-refresh", tags=["security-cvm"])


@router.post(
    "/lease",
    summary="Lease the refresh of a rotating refresh token (one replica at a time).",
    responses={409: {"description": "Leased by another replica"}, 412: {"description": "Stale"}},
)
async def lease(
    cvm_id: CvmIdPath, body: SecretAt, caller: SecurityCvmDep, console: ConsoleDep
) -> LeaseGrant:
    require_same_cvm(caller, cvm_id)
    return await run_in_threadpool(secret_refresh.acquire_lease, console, caller, body)


@router.post(
    "/commit",
    summary="Store a rotated refresh token as the next version, under the lease.",
    responses={412: {"description": "The lease or version no longer holds"}},
)
async def commit(
    cvm_id: CvmIdPath, body: RefreshCommit, caller: SecurityCvmDep, console: ConsoleDep
) -> RefreshCommitted:
    require_same_cvm(caller, cvm_id)
    return await run_in_threadpool(secret_refresh.commit_refresh, console, caller, body)


@router.post(
    "/failure",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Give the lease back; a refusal marks the secret as needing a new login.",
)
async def failure(
    cvm_id: CvmIdPath, body: RefreshFailure, caller: SecurityCvmDep, console: ConsoleDep
) -> Response:
    require_same_cvm(caller, cvm_id)
    await run_in_threadpool(secret_refresh.report_failure, console, caller, body)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
