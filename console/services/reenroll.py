"""Re-enrollment by fresh quote (console/reenrollment.py) as a service: one renewal of a CVM at a
time, a refusal audited in its own transaction (the attempt's is rolled back) and raised as a
domain error: `Forbidden` with its reason, or `Conflict` for `not_enrolled` (the client then
enrolls with its token; not audited, every first boot asks it once)."""

from __future__ import annotations

from umbra.console import audit, reenrollment
from umbra.console.enums import AuditAction
from umbra.console.reenrollment import (
    RenewalRefusal,
    RenewalRefused,
    RenewChallengeRequest,
    RenewEvidence,
)
from umbra.console.services.errors import Conflict, Forbidden, ServiceError
from umbra.console.state import Console

# What a renewal quote's report data binds (the client computes the same).
REPORT_DATA_RULE = (
    'SHA-512("umbra-renew-v1\\0" || nonce || "\\0" || cvm_id || "\\0" || x25519_public_key)'
)


def renew_lock(cvm_id: str) -> str:
    """One renewal of a CVM at a time: of parallel attempts with one nonce exactly one wins."""
    return f"renew:{cvm_id}"


def _refused(console: Console, cvm_id: str, exc: RenewalRefused) -> ServiceError:
    detail = f"renewal refused: {exc.reason.value}"
    if exc.reason is RenewalRefusal.not_enrolled:
        return Conflict(detail)
    with console.write(renew_lock(cvm_id)) as session:
        team, target = reenrollment.spend_nonce(session, cvm_id)
        audit.append(
            session, actor=f"cvm:{target}", team=team, action=AuditAction.cvm_reenroll_refused,
            target=target, details={"reason": exc.reason.value},
        )  # fmt: skip
    return Forbidden(detail)


def renew_challenge(*, console: Console, request: RenewChallengeRequest) -> str:
    """A single-use nonce for re-enrolling the enrolled CVM `request.cvm_id`."""
    try:
        with console.write(renew_lock(request.cvm_id)) as session:
            return reenrollment.renew_challenge(session, request)
    except RenewalRefused as exc:
        raise _refused(console, request.cvm_id, exc) from None


def renew(*, console: Console, evidence: RenewEvidence) -> tuple[str, bytes]:
    """The CVM's id and its new credential sealed to the quote's key."""
    try:
        with console.write(renew_lock(evidence.cvm_id)) as session:
            cvm_id, sealed = reenrollment.renew(session, console.enrollment_verifiers, evidence)
    except RenewalRefused as exc:
        raise _refused(console, evidence.cvm_id, exc) from None
    # A Dev CVM's new credential hash reaches its Security CVM through the attachments document.
    console.notifier.notify()
    return cvm_id, sealed
