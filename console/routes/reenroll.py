"""Re-enrollment by fresh quote (console/reenrollment.py): no token, no user, a quote of the
CVM's release whose measured launch equals the one its token enrollment showed.

The logic (locks, the audited refusal) is `services/reenroll.py`: a refusal is answered 403 with
its reason, `not_enrolled` 409 (routes/errors.py maps them).
"""

from __future__ import annotations

import base64

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from umbra.console.deps import ConsoleDep
from umbra.console.reenrollment import RenewChallengeRequest, RenewEvidence
from umbra.console.services import reenroll

router = APIRouter(prefix="/api/v1", tags=["enrollment"])


class RenewChallenge(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nonce: str
    report_data_rule: str


class Renewed(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cvm_id: str
    sealed_credential: str = Field(description="Base64 HPKE enc ‖ ciphertext of the credential.")


@router.post(
    "/enroll/renew/challenge",
    summary="A single-use nonce for re-enrolling an enrolled CVM by a fresh quote.",
    responses={409: {"description": "Not enrolled (or another launch): enroll with a token"}},
)
def renew_challenge(body: RenewChallengeRequest, console: ConsoleDep) -> RenewChallenge:
    nonce = reenroll.renew_challenge(console=console, request=body)
    return RenewChallenge(nonce=nonce, report_data_rule=reenroll.REPORT_DATA_RULE)


@router.post(
    "/enroll/renew",
    summary="Trade a fresh quote of the CVM's measured launch for a new credential.",
    responses={403: {"description": "Refused (audited)"}, 409: {"description": "Not enrolled"}},
)
async def renew(body: RenewEvidence, console: ConsoleDep) -> Renewed:
    cvm_id, sealed = await run_in_threadpool(reenroll.renew, console=console, evidence=body)
    return Renewed(cvm_id=cvm_id, sealed_credential=base64.b64encode(sealed).decode())
