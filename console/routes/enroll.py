"""Enrollment: one-time tokens for launch data, and credentials only after attestation.

Handlers delegate to `console/enrollment.py`: a challenge and the evidence check only read; the
token is spent in a short write transaction under the CVM's lock. A refusal is audited in its own
transaction (the attempt's is rolled back), rate-limited (refusal_budget.py), and answered 403
with its reason.
"""

from __future__ import annotations

import base64
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, status
from fastapi.concurrency import run_in_threadpool
from pydantic import Field
from sqlalchemy.orm import Session

from umbra.console import audit, enrollment, refusal_budget, security_pool
from umbra.console.console_keys import ENROLL_NONCE_KEY
from umbra.console.deps import ConsoleDep, UserDep
from umbra.console.enrollment import EnrollEvidence, EnrollmentRefused
from umbra.console.enums import AuditAction, CvmState, Role
from umbra.console.routes.common import CvmIdPath, TeamPath
from umbra.console.schemas import EnrollmentToken, SecurityReplicaToken
from umbra.console.services.access import cvm_lock, require_role, visible_cvm
from umbra.console.state import Console
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
    with console.write() as session:
        cvm = visible_cvm(session, user, cvm_id)
        require_role(user, cvm.team, Role.admin)
        if cvm.state == CvmState.destroyed:
            raise HTTPException(status.HTTP_409_CONFLICT, f"CVM {cvm_id} is destroyed")
        token, expires = enrollment.issue_token(session, cvm, user.subject)
    return EnrollmentToken(cvm_id=cvm_id, token=token, expires_at=expires)


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
    require_role(user, team, Role.admin)
    with console.write(security_pool.pool_lock(team)) as session:
        try:
            cvm, token, expires, created = security_pool.register(
                session, team, replica, user.subject
            )
        except security_pool.PoolError as exc:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
        minted = SecurityReplicaToken(
            team=team, replica=replica, cvm_id=cvm.id, pool_id=security_pool.pool_id(cvm),
            created=created, token=token, expires_at=expires,
        )  # fmt: skip
    console.notifier.notify()
    return minted


def _refused(console: Console, token: str, exc: EnrollmentRefused) -> HTTPException:
    """Audit a refusal (rate-limited per team key, refusal_budget.py) and answer 403. One that
    fails a never-enrolled CVM is always audited: it changes the CVM."""
    with console.session() as session:
        team, target = enrollment.refusal_target(session, token)
    marked = False
    if target != "-" and exc.reason.value in enrollment.PROVISIONING_FAILURES:
        with console.write(cvm_lock(target)) as session:
            marked = enrollment.mark_unprovisionable(session, token, exc.reason)
            if marked:
                _audit_refusal(session, team, target, exc)
                audit.append(
                    session, actor="umbra-console", team=team, action=AuditAction.cvm_provisioned,
                    target=target, details={"operation": "enroll", "state": CvmState.failed,
                                            "reason": enrollment.FAILED_PREFIX + exc.reason.value},
                )  # fmt: skip
        if marked:
            console.notifier.notify()
    if not marked:
        admitted, summaries = console.refusals.admit(team, exc.reason.value)
        if admitted or summaries:
            with console.write() as session:
                refusal_budget.write_summaries(session, summaries)
                if admitted:
                    _audit_refusal(session, team, target, exc)
    return HTTPException(status.HTTP_403_FORBIDDEN, f"enrollment refused: {exc.reason.value}")


def _audit_refusal(session: Session, team: str, target: str, exc: EnrollmentRefused) -> None:
    audit.append(
        session, actor=f"cvm:{target}", team=team, action=AuditAction.cvm_enroll_refused,
        target=target, details={"reason": exc.reason.value},
    )  # fmt: skip


@router.post("/enroll/challenge", summary="A nonce for enrollment attempts with one token (2 min).")
def enroll_challenge(body: ChallengeRequest, console: ConsoleDep) -> EnrollChallenge:
    try:
        with console.session() as session:  # reads only: a challenge never spends another's
            nonce = enrollment.challenge(session, console.keys.get(ENROLL_NONCE_KEY), body.token)
    except EnrollmentRefused as exc:
        raise _refused(console, body.token, exc) from None
    return EnrollChallenge(
        nonce=nonce,
        report_data_rule='SHA-512("umbra-enroll-v1\\0" || nonce || "\\0" || cvm_id || "\\0" || '
        "x25519_public_key)",
    )


@router.post(
    "/enroll",
    summary="Trade the token and a quote binding a TEE-held key for the CVM's credential.",
    responses={403: {"description": "Refused (audited)"}},
)
async def enroll(body: EnrollEvidence, console: ConsoleDep) -> Enrolled:
    return await run_in_threadpool(_enroll, console, body)


def _enroll(console: Console, body: EnrollEvidence) -> Enrolled:
    try:
        with console.session() as session:
            verified = enrollment.verify(
                session, console.enrollment_verifiers, console.keys.get(ENROLL_NONCE_KEY), body
            )
        with console.write(cvm_lock(verified.cvm_id)) as session:
            cvm_id, sealed = enrollment.redeem(session, verified, body)
    except EnrollmentRefused as exc:
        raise _refused(console, body.token, exc) from None
    return Enrolled(cvm_id=cvm_id, sealed_credential=base64.b64encode(sealed).decode())
