"""Enrollment as a service: one-time tokens for launch data (admins), and credentials only after
attestation. Attempts with one token are serialized; a refusal is audited in its own transaction
(the attempt's is rolled back) and raised as `Forbidden` with its reason."""

from __future__ import annotations

from umbra.console import audit, enrollment, security_pool
from umbra.console.enrollment import EnrollEvidence, EnrollmentRefused
from umbra.console.enums import AuditAction, CvmState, Role
from umbra.console.schemas import EnrollmentToken, SecurityReplicaToken
from umbra.console.services.access import User, require_role, visible_cvm
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


def token_lock(token: str) -> str:
    """Challenges and enrollments of one token are serialized: of parallel attempts with the
    same evidence exactly one issues a credential, the others see the token used."""
    return f"enroll:{enrollment.token_digest(token)}"


def _refused(console: Console, token: str, exc: EnrollmentRefused) -> Forbidden:
    with console.write(token_lock(token)) as session:
        team, target = enrollment.refusal_target(session, token)
        row = session.get(enrollment.CvmEnrollment, enrollment.token_digest(token))
        if row is not None:  # a nonce is good for one attempt, successful or not
            row.nonce = None
            session.add(row)
        audit.append(
            session, actor=f"cvm:{target}", team=team, action=AuditAction.cvm_enroll_refused,
            target=target, details={"reason": exc.reason.value},
        )  # fmt: skip
        if enrollment.mark_unprovisionable(session, token, exc.reason):
            audit.append(
                session, actor="umbra-console", team=team, action=AuditAction.cvm_provisioned,
                target=target, details={"operation": "enroll", "state": CvmState.failed,
                                        "reason": enrollment.FAILED_PREFIX + exc.reason.value},
            )  # fmt: skip
    if exc.reason.value in enrollment.PROVISIONING_FAILURES:
        console.notifier.notify()
    return Forbidden(f"enrollment refused: {exc.reason.value}")


def challenge(*, console: Console, token: str) -> str:
    """A single-use nonce for one enrollment attempt with `token`."""
    try:
        with console.write(token_lock(token)) as session:
            return enrollment.challenge(session, token)
    except EnrollmentRefused as exc:
        raise _refused(console, token, exc) from None


def enroll(*, console: Console, evidence: EnrollEvidence) -> tuple[str, bytes]:
    """The CVM's id and its credential sealed to the quote's key."""
    try:
        with console.write(token_lock(evidence.token)) as session:
            return enrollment.enroll(session, console.enrollment_verifiers, evidence)
    except EnrollmentRefused as exc:
        raise _refused(console, evidence.token, exc) from None
