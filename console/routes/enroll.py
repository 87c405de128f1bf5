"""Enrollment: one-time tokens for launch data, and credentials only after attestation.

Handlers delegate to `services/enroll.py` (over `console/enrollment.py`); a refusal is audited
there in its own transaction and answered 403 with its reason (routes/errors.py).
"""

from __future__ import annotations

import base64
from typing import Annotated

from fastapi import APIRouter, Path, status
from fastapi.concurrency import run_in_threadpool
from pydantic import Field

from umbra.console import security_pool
from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.enrollment import EnrollEvidence
from umbra.console.routes.common import CvmIdPath, TeamPath
from umbra.console.schemas import EnrollmentToken, SecurityReplicaToken
from umbra.console.services import enroll as enroll_service
from umbra.contracts.model import Strict

router = APIRouter(prefix="/api/v1", tags=["enrollment"])


class ChallengeRequest(Strict):
    token: str = Field(min_length=8, max_length=128)


class EnrollChallenge(Strict):
    nonce: str
    report_data_rule: str


class Enrolled(Strict):
    cvm_id: str
    sealed_credential: str = Field(description="Base64 HPKE enc ‖ ciphertext of the credential.")


@router.post(
    "/cvms/{cvm_id}/enrollment-token",
    status_code=status.HTTP_201_CREATED,
    summary="A one-time enrollment token for a CVM's launch data (admin).",
)
def create_token(cvm_id: CvmIdPath, console: ConsoleDep, user: UserDep) -> EnrollmentToken:
    return enroll_service.issue_token(console=console, user=user, cvm_id=cvm_id)


ReplicaPath = Annotated[
    int, Path(ge=0, lt=security_pool.MAX_REPLICAS, description="The team stack's replica number.")
]


@router.post(
    "/teams/{team}/security-replicas/{replica}/enrollment-token",
    status_code=status.HTTP_201_CREATED,
    summary="Register replica N of the team's Security CVM pool and mint its token (admin).",
)
def replica_token(
    team: TeamPath, replica: ReplicaPath, console: ConsoleDep, user: UserDep
) -> SecurityReplicaToken:
    """Idempotent per replica: the record is created once, every call mints a fresh one-time
    token (for a replica that booted after its token expired, or a relaunched VM)."""
    return enroll_service.replica_token(console=console, user=user, team=team, replica=replica)


@router.post("/enroll/challenge", summary="A nonce for enrollment attempts with one token (2 min).")
def enroll_challenge(body: ChallengeRequest, console: ConsoleDep) -> EnrollChallenge:
    nonce = enroll_service.challenge(console=console, token=body.token)
    return EnrollChallenge(nonce=nonce, report_data_rule=enroll_service.REPORT_DATA_RULE)


@router.post(
    "/enroll",
    summary="Trade the token and a quote binding a TEE-held key for the CVM's credential.",
    responses={403: {"description": "Refused (audited)"}},
)
async def enroll(body: EnrollEvidence, console: ConsoleDep) -> Enrolled:
    cvm_id, sealed = await run_in_threadpool(enroll_service.enroll, console=console, evidence=body)
    return Enrolled(cvm_id=cvm_id, sealed_credential=base64.b64encode(sealed).decode())
