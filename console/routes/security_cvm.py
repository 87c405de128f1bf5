"""What a Security CVM pulls: its team's signed bundle, the attachments of the Dev CVMs it serves,
and (after attestation) their secrets. Pull only; the Console never pushes to a Security CVM.

A replica (console/security_pool.py) serves its pool: the Dev CVMs routed to the pool's first
Security CVM, whichever replica the load balancer hands them to. Everything else stays per
replica: its credential, its release nonces and quote binding, its audit actor, its records.

The work is in services/security_cvm.py; these routes add the long polls and the headers."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response, status
from starlette.concurrency import run_in_threadpool

from umbra.console.deps import ConsoleDep, SecurityCvmDep, require_same_cvm
from umbra.console.longpoll import watch
from umbra.console.release import ReleaseEvidence
from umbra.console.routes.common import CvmIdPath
from umbra.console.schemas import AttachmentsDoc, ReleaseChallenge, ReleaseResponse
from umbra.console.services import security_cvm
from umbra.console.services.errors import NotFound

router = APIRouter(prefix="/api/v1/security-cvms/{cvm_id}", tags=["security-cvm"])
IfNoneMatch = Annotated[str | None, Header(alias="If-None-Match", max_length=1024)]
Wait = Annotated[
    int, Query(ge=0, le=600, description="Long poll: seconds to wait for a change (capped).")
]


@router.get(
    "/bundle",
    summary="The team's current signed bundle (ETag = bundle hash; long poll with ?wait=).",
    responses={
        200: {"content": {"application/json": {}}, "description": "Signed bundle bytes"},
        304: {"description": "Unchanged"},
        404: {"description": "No bundle uploaded yet"},
    },
)
async def get_bundle(
    request: Request,
    cvm_id: CvmIdPath,
    caller: SecurityCvmDep,
    console: ConsoleDep,
    if_none_match: IfNoneMatch = None,
    wait: Wait = 0,
) -> Response:
    require_same_cvm(caller, cvm_id)
    # No bundle yet keeps the poll waiting: the first upload answers it.
    watched = await watch(
        console,
        lambda: security_cvm.bundle(console=console, team=caller.team),
        lambda bundle: bundle[0],
        if_none_match,
        wait,
        request.is_disconnected,
    )
    if watched.value is None:
        raise NotFound(f"team {caller.team!r} has no policy bundle")
    _hash, serial, raw = watched.value
    headers = watched.etag_header | {"X-Umbra-Bundle-Serial": str(serial)}
    if watched.unchanged:
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=headers)
    return Response(content=raw, media_type="application/json", headers=headers)


@router.get(
    "/attachments",
    response_model=AttachmentsDoc,
    summary="Profiles and owners of the Dev CVMs this Security CVM serves (ETag; long poll).",
    responses={304: {"description": "Unchanged"}},
)
async def get_attachments(
    request: Request,
    cvm_id: CvmIdPath,
    caller: SecurityCvmDep,
    console: ConsoleDep,
    response: Response,
    if_none_match: IfNoneMatch = None,
    wait: Wait = 0,
) -> Any:
    require_same_cvm(caller, cvm_id)
    watched = await watch(
        console,
        lambda: security_cvm.attachments_document(console=console, caller=caller),
        security_cvm.document_etag,
        if_none_match,
        wait,
        request.is_disconnected,
    )
    if watched.unchanged:
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=watched.etag_header)
    response.headers.update(watched.etag_header)
    return AttachmentsDoc.model_validate(watched.value)


@router.get(
    "/secrets/version",
    summary="Version of the secrets a release would carry (ETag; long poll with ?wait=; no values).",
    responses={304: {"description": "Unchanged"}},
)
async def get_secrets_version(
    request: Request,
    cvm_id: CvmIdPath,
    caller: SecurityCvmDep,
    console: ConsoleDep,
    if_none_match: IfNoneMatch = None,
    wait: Wait = 0,
) -> Response:
    require_same_cvm(caller, cvm_id)
    watched = await watch(
        console,
        lambda: security_cvm.secrets_version(console=console, caller=caller),
        lambda v: v,
        if_none_match,
        wait,
        request.is_disconnected,
    )
    if watched.unchanged:
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=watched.etag_header)
    return Response(
        content=json.dumps({"version": watched.value}),
        media_type="application/json",
        headers=watched.etag_header,
    )


@router.post(
    "/release-challenge",
    summary="A single-use nonce to bind into the quote for a secret release.",
)
def release_challenge(
    cvm_id: CvmIdPath, caller: SecurityCvmDep, console: ConsoleDep
) -> ReleaseChallenge:
    require_same_cvm(caller, cvm_id)
    return security_cvm.release_challenge(console=console, caller=caller)


@router.post(
    "/secrets/release",
    summary="Release the secrets this Security CVM needs, HPKE-sealed to its attested key.",
    responses={403: {"description": "Evidence refused"}, 503: {"description": "Not configured"}},
)
async def release_secrets(
    cvm_id: CvmIdPath, evidence: ReleaseEvidence, caller: SecurityCvmDep, console: ConsoleDep
) -> ReleaseResponse:
    require_same_cvm(caller, cvm_id)
    return await run_in_threadpool(
        lambda: security_cvm.release(console=console, caller=caller, evidence=evidence)
    )
