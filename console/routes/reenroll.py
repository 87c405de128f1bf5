"""Re-enrollment by fresh quote (console/reenrollment.py): no token, no user, a quote of the
CVM's release whose measured launch equals the one its token enrollment showed.

A refusal is audited in its own transaction (the attempt's is rolled back) and answered 403 with
its reason; `not_enrolled` is 409 (the client then enrolls with its token) and is not audited:
every first boot asks it once.
"""

from __future__ import annotations

import base64

from fastapi import APIRouter, HTTPException, status
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from umbra.console import audit, reenrollment
from umbra.console.deps import ConsoleDep
from umbra.console.enums import AuditAction
from umbra.console.reenrollment import (
    RenewalRefusal,
    RenewalRefused,
    RenewChallengeRequest,
    RenewEvidence,
)
from umbra.console.state import Console

router = APIRouter(prefix="/api/v1", tags=["enrollment"])


class RenewChallenge(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nonce: str
    report_data_rule: str


class Renewed(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cvm_id: str
    sealed_credential: str = Field(description="Base64 HPKE enc ‖ ciphertext of the credential.")


def _lock(cvm_id: str) -> str:
    """One renewal of a CVM at a time: of parallel attempts with one nonce exactly one wins."""
    return f"renew:{cvm_id}"


def _refused(console: Console, cvm_id: str, exc: RenewalRefused) -> HTTPException:
    if exc.reason is RenewalRefusal.not_enrolled:
        return HTTPException(status.HTTP_409_CONFLICT, f"renewal refused: {exc.reason.value}")
    with console.write(_lock(cvm_id)) as session:
        team, target = reenrollment.spend_nonce(session, cvm_id)
        audit.append(
            session, actor=f"cvm:{target}", team=team, action=AuditAction.cvm_reenroll_refused,
            target=target, details={"reason": exc.reason.value},
        )  # fmt: skip
    return HTTPException(status.HTTP_403_FORBIDDEN, f"renewal refused: {exc.reason.value}")


@router.post(
    "/enroll/renew/challenge",
    summary="A single-use nonce for re-enrolling an enrolled CVM by a fresh quote.",
    responses={409: {"description": "Not enrolled (or another launch): enroll with a token"}},
)
def renew_challenge(body: RenewChallengeRequest, console: ConsoleDep) -> RenewChallenge:
    try:
        with console.write(_lock(body.cvm_id)) as session:
            nonce = reenrollment.renew_challenge(session, body)
    except RenewalRefused as exc:
        raise _refused(console, body.cvm_id, exc) from None
    return RenewChallenge(
        nonce=nonce,
        report_data_rule='SHA-512("umbra-renew-v1\\0" || nonce || "\\0" || cvm_id || "\\0" || '
        "x25519_public_key)",
    )


@router.post(
    "/enroll/renew",
    summary="Trade a fresh quote of the CVM's measured launch for a new credential.",
    responses={403: {"description": "Refused (audited)"}, 409: {"description": "Not enrolled"}},
)
async def renew(body: RenewEvidence, console: ConsoleDep) -> Renewed:
    return await run_in_threadpool(_renew, console, body)


def _renew(console: Console, body: RenewEvidence) -> Renewed:
    try:
        with console.write(_lock(body.cvm_id)) as session:
            cvm_id, sealed = reenrollment.renew(session, console.enrollment_verifiers, body)
    except RenewalRefused as exc:
        raise _refused(console, body.cvm_id, exc) from None
    # A Dev CVM's new credential hash reaches its Security CVM through the attachments document.
    console.notifier.notify()
    return Renewed(cvm_id=cvm_id, sealed_credential=base64.b64encode(sealed).decode())
