"""Enrollment as a service: one-time tokens for launch data (admins), and credentials only after
attestation. A challenge and the evidence check only read (nonces are signed, not stored); the
token is spent in a short write transaction under the CVM's lock, by one conditional UPDATE. A
refusal is audited in its own transaction (the attempt's is rolled back), rate-limited per team
key and minute (refusal_budget.py), and raised as `Forbidden` with its reason."""

from __future__ import annotations

from sqlalchemy.orm import Session

from umbra.console import audit, enrollment, refusal_budget, security_pool
from umbra.console.console_keys import ENROLL_NONCE_KEY
from umbra.console.enrollment import EnrollEvidence, EnrollmentRefused
from umbra.console.enums import AuditAction, CvmState, Role
from umbra.console.schemas import EnrollmentToken, SecurityReplicaToken
from umbra.console.services.access import User, cvm_lock, require_role, visible_cvm
from umbra.console.services.errors import Conflict, Forbidden, Invalid
from umbra.console.state import Console

# What an enrollment quote's report data binds (the client computes the same).
REPORT_DATA_RULE = (
    'SHA-512("umbra-enroll-v1\\0" || nonce || "\\0" || cvm_id || "\\0" || x25519_public_key)'
)


def issue_token(*, console: Console, user: User, cvm_id: str) -> EnrollmentToken:
    """A one-time enrollment token for a CVM's launch data (admins of its team)."""
    with console.write() as session:
        cvm = visible_cvm(session, user, cvm_id)
        require_role(user, cvm.team, Role.admin)
        if cvm.state == CvmState.destroyed:
            raise Conflict(f"CVM {cvm_id} is destroyed")
        token, expires = enrollment.issue_token(session, cvm, user.subject)
    return EnrollmentToken(cvm_id=cvm_id, token=token, expires_at=expires)


def replica_token(*, console: Console, user: User, team: str, replica: int) -> SecurityReplicaToken:
    """Register replica `replica` of the team's Security CVM pool (once) and mint a fresh one-time
    token for it (every call: for a replica that booted after its token expired, or a relaunched
    VM)."""
    require_role(user, team, Role.admin)
    with console.write(security_pool.pool_lock(team)) as session:
        try:
            cvm, token, expires, created = security_pool.register(
                session, team, replica, user.subject
            )
        except security_pool.PoolError as exc:
            raise Invalid(str(exc)) from None
        minted = SecurityReplicaToken(
            team=team, replica=replica, cvm_id=cvm.id, pool_id=security_pool.pool_id(cvm),
            created=created, token=token, expires_at=expires,
        )  # fmt: skip
    console.notifier.notify()
    return minted


def _refused(console: Console, token: str, exc: EnrollmentRefused) -> Forbidden:
    """Audit a refusal (rate-limited per team key, refusal_budget.py). One that fails a
    never-enrolled CVM is always audited: it changes the CVM."""
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
    return Forbidden(f"enrollment refused: {exc.reason.value}")


def _audit_refusal(session: Session, team: str, target: str, exc: EnrollmentRefused) -> None:
    audit.append(
        session, actor=f"cvm:{target}", team=team, action=AuditAction.cvm_enroll_refused,
        target=target,
        # The verifier's own words (which value differed): what an operator needs to act on.
        details={"reason": exc.reason.value, **({"detail": exc.detail} if exc.detail else {})},
    )  # fmt: skip


def challenge(*, console: Console, token: str) -> str:
    """A nonce for enrollment attempts with `token` (2 min); reads only, so no caller's challenge
    invalidates another's."""
    try:
        with console.session() as session:
            return enrollment.challenge(session, console.keys.get(ENROLL_NONCE_KEY), token)
    except EnrollmentRefused as exc:
        raise _refused(console, token, exc) from None


def enroll(*, console: Console, evidence: EnrollEvidence) -> tuple[str, bytes]:
    """The CVM's id and its credential sealed to the quote's key: the evidence is checked by
    reads (no lock held while the quote verifies), then the token is spent (one winner)."""
    try:
        with console.session() as session:
            verified = enrollment.verify(
                session, console.enrollment_verifiers, console.keys.get(ENROLL_NONCE_KEY), evidence
            )
        with console.write(cvm_lock(verified.cvm_id)) as session:
            return enrollment.redeem(session, verified, evidence)
    except EnrollmentRefused as exc:
        raise _refused(console, evidence.token, exc) from None
