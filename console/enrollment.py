"""Credentials only after attestation: a CVM trades a one-time enrollment token plus a quote for
its long-lived credential.

Launch data (which the cloud operator can read) carries at most the enrollment token. The booted
CVM asks for a single-use nonce, generates an X25519 key inside the TEE and puts
`SHA-512("umbra-enroll-v1\\0" ‖ nonce ‖ \\0 ‖ cvm_id ‖ \\0 ‖ public_key)` in its quote's report_data.
The Console verifies the quote against that CVM's release (measurement policy, collateral, event
log) and only then issues the credential, HPKE-sealed to the bound key: the operator who copied
the token cannot use it without a genuine TD of the right release, and cannot read the credential.

Nonces are stateless: `base64url(expiry ‖ random ‖ HMAC(key, token digest ‖ expiry ‖ random))`
under a key the replicas share (console_keys.py). A challenge writes nothing, so no caller's
challenge can invalidate another's (a copied token polling `/enroll/challenge` used to overwrite
the genuine CVM's nonce); any replica can check any nonce. Single use belongs to the token and is
decided at redeem by one conditional UPDATE (`used_at IS NULL`): of parallel enrollments with one
token exactly one wins, the rest are `reused_token`.

Refusals (unknown/expired/reused token, a wrong or expired nonce, a quote that does not verify or binds something
else) are audited with their reason and never issue anything. A reused token also revokes nothing
already issued: the first enrollment stands, the second is refused and audited.

Each CVM kind is verified against its own release (`Console.enrollment_verifiers`: the Security
CVM image's `release_policy`, the Dev CVM image's `dev_cvm_release_policy`); a kind without one is
refused as `no_release_policy`. A Security CVM receives its Console bearer credential, a Dev CVM
its tunnel credential (whose hash its Security CVM learns from the attachments document).

A CVM that never enrolled and whose valid token met a quote that does not verify, or whose
token expired before it enrolled, is marked `failed` with the reason (it cannot be provisioned);
a later successful enrollment with a new token brings it back to `running`. Refusals of unknown
or reused tokens never touch the CVM (a replay cannot fail an enrolled one).

A CVM that never reached the Console at all (the Console unreachable from it: its client retried
with backoff and gave up, attest/enroll_client.py) presents nothing to refuse. Listing or reading
CVMs marks one that never enrolled, whose every token expired unused, `failed` with
`NEVER_CONTACTED` (same prefix: a new token and a successful enrollment still bring it back), so
`umbra cvm list` shows why.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from pydantic import Field as PydanticField
from sqlalchemy import Column, DateTime, func, select, update
from sqlalchemy.orm import Session
from sqlmodel import Field, SQLModel, col

from umbra.attest.errors import AttestError
from umbra.attest.eventlog import Event, load_event_log
from umbra.console import audit, reenrollment
from umbra.console.enums import AuditAction, CvmKind, CvmState
from umbra.console.instance_policy import instance_verifier
from umbra.console.models import Cvm, utcnow
from umbra.console.release import AttestedReleaseVerifier, seal_release
from umbra.console.services.access import credential_hash
from umbra.contracts.enrollment import (
    SECURITY_CVM_CREDENTIAL_PREFIX,
    TOKEN_PREFIX,
    TUNNEL_CREDENTIAL_PREFIX,
    hpke_info,
    report_data,
)
from umbra.contracts.model import Strict
from umbra.contracts.release import SUITE

# Re-exported for the Console's tests and callers.
__all__ = ["TOKEN_PREFIX", "hpke_info", "report_data"]
CREDENTIAL_PREFIXES = {
    CvmKind.security: SECURITY_CVM_CREDENTIAL_PREFIX,
    CvmKind.dev: TUNNEL_CREDENTIAL_PREFIX,
}
# Refusals that mean "this CVM, holding its valid token, is not what its release says", and an
# expired token (a CVM that booted too late, e.g. a team stack's replica whose token waited in
# Pulumi config past TOKEN_TTL): a never-enrolled CVM refused for one of these is `failed` with
# the reason, so the operator sees it and re-issues a token.
PROVISIONING_FAILURES = frozenset(
    {"no_release_policy", "bad_evidence", "attestation_failed", "expired_token"}
)

TOKEN_TTL = timedelta(hours=1)
NONCE_TTL = timedelta(minutes=2)
_NONCE_CONTEXT = b"umbra-enroll-nonce-v1\x00"
_NONCE_RANDOM = 12
_NONCE_MAC = 32  # 4 + 12 + 32 bytes = 64 base64url characters, what EnrollEvidence accepts
FAILED_PREFIX = "enrollment refused: "
NEVER_CONTACTED = (
    "no_contact: the CVM never reached the Console before its enrollment token expired at {at} "
    "(is the Console reachable from it? its serial console says)"
)
_ = SUITE  # the suite the seal uses (release_protocol); named here for readers


class RefusalReason(enum.StrEnum):
    unknown_token = "unknown_token"  # noqa: S105 -- a reason, not a token
    expired_token = "expired_token"  # noqa: S105 -- a reason, not a token
    reused_token = "reused_token"  # noqa: S105 -- a reason, not a token
    wrong_nonce = "wrong_nonce"
    cvm_gone = "cvm_gone"
    no_release_policy = "no_release_policy"
    bad_evidence = "bad_evidence"
    attestation_failed = "attestation_failed"


class EnrollmentRefused(Exception):
    def __init__(self, reason: RefusalReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


class CvmEnrollment(SQLModel, table=True):
    __tablename__ = "cvm_enrollment"

    token_sha256: str = Field(primary_key=True, max_length=64)
    cvm_id: str = Field(max_length=64, index=True)
    created_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
    expires_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
    used_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )


class EnrollEvidence(Strict):
    token: str = PydanticField(min_length=8, max_length=128)
    nonce: str = PydanticField(pattern=r"^[A-Za-z0-9_-]{16,64}$")
    quote: str = PydanticField(max_length=64 << 10, description="Base64 TDX quote.")
    event_log: str | None = PydanticField(default=None, max_length=1 << 20)
    public_key: str = PydanticField(max_length=64, description="Base64 raw X25519 key.")


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=utcnow().tzinfo)


def issue_token(session: Session, cvm: Cvm, actor: str) -> tuple[str, datetime]:
    """A fresh one-time token for `cvm` (the launch data carries it)."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    now = utcnow()
    row = CvmEnrollment(
        token_sha256=token_digest(token), cvm_id=cvm.id, created_at=now, expires_at=now + TOKEN_TTL
    )
    session.add(row)
    audit.append(
        session, actor=actor, team=cvm.team, action=AuditAction.cvm_enrollment_token, target=cvm.id,
        details={"expires_at": row.expires_at.isoformat()},
    )  # fmt: skip
    return token, row.expires_at


def _live(session: Session, token: str) -> tuple[CvmEnrollment, Cvm]:
    row = session.get(CvmEnrollment, token_digest(token))
    if row is None:
        raise EnrollmentRefused(RefusalReason.unknown_token)
    if row.used_at is not None:
        raise EnrollmentRefused(RefusalReason.reused_token, f"used at {row.used_at.isoformat()}")
    if _aware(row.expires_at) < utcnow():
        raise EnrollmentRefused(RefusalReason.expired_token)
    cvm = session.get(Cvm, row.cvm_id)
    if cvm is None or cvm.state == CvmState.destroyed:
        raise EnrollmentRefused(RefusalReason.cvm_gone)
    return row, cvm


def _nonce_mac(key: bytes, digest: str, head: bytes) -> bytes:
    return hmac.digest(key, _NONCE_CONTEXT + bytes.fromhex(digest) + head, "sha256")


def make_nonce(key: bytes, token: str, now: datetime | None = None) -> str:
    """A nonce for one token, good until NONCE_TTL from now, checkable by any replica."""
    expiry = int(((now or utcnow()) + NONCE_TTL).timestamp())
    head = expiry.to_bytes(4, "big") + secrets.token_bytes(_NONCE_RANDOM)
    raw = head + _nonce_mac(key, token_digest(token), head)
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def nonce_valid(key: bytes, token: str, nonce: str, now: datetime | None = None) -> bool:
    try:
        raw = base64.urlsafe_b64decode(nonce + "=" * (-len(nonce) % 4))
    except (binascii.Error, ValueError):
        return False
    if len(raw) != 4 + _NONCE_RANDOM + _NONCE_MAC:
        return False
    head, mac = raw[: 4 + _NONCE_RANDOM], raw[4 + _NONCE_RANDOM :]
    if not hmac.compare_digest(mac, _nonce_mac(key, token_digest(token), head)):
        return False
    return int.from_bytes(head[:4], "big") >= int((now or utcnow()).timestamp())


def challenge(session: Session, key: bytes, token: str) -> str:
    """A nonce for a live token; reads only (nothing another challenge could overwrite)."""
    _live(session, token)
    return make_nonce(key, token)


def mark_unprovisionable(session: Session, token: str, reason: RefusalReason) -> bool:
    """A never-enrolled CVM whose valid token met evidence that does not verify is `failed`
    with the reason, never `running`. Returns whether it was marked."""
    if reason.value not in PROVISIONING_FAILURES:
        return False
    row = session.get(CvmEnrollment, token_digest(token))
    cvm = session.get(Cvm, row.cvm_id) if row is not None else None
    if cvm is None or cvm.credential_hash is not None:
        return False
    if cvm.state not in (CvmState.running, CvmState.pending):
        return False
    cvm.state, cvm.state_reason = CvmState.failed, FAILED_PREFIX + reason.value
    cvm.updated_at = utcnow()
    session.add(cvm)
    return True


def mark_never_contacted(session: Session, team: str, now: datetime | None = None) -> list[str]:
    """Mark the team's running or pending CVMs that never enrolled and whose tokens all expired
    unused `failed` (NEVER_CONTACTED); returns their ids."""
    now = now or utcnow()
    rows = session.execute(
        select(col(CvmEnrollment.cvm_id), func.max(col(CvmEnrollment.expires_at)))
        .join(Cvm, col(Cvm.id) == col(CvmEnrollment.cvm_id))
        .where(col(Cvm.team) == team)
        .where(col(Cvm.credential_hash).is_(None))
        .where(col(Cvm.state).in_([CvmState.running, CvmState.pending]))
        .group_by(col(CvmEnrollment.cvm_id))
        .having(func.count(col(CvmEnrollment.used_at)) == 0)
    ).all()
    marked = []
    for cvm_id, last in rows:
        if _aware(last) >= now:
            continue
        cvm = session.get(Cvm, cvm_id)
        if cvm is None:
            continue
        at = _aware(last).strftime("%Y-%m-%dT%H:%M:%SZ")
        cvm.state, cvm.state_reason = CvmState.failed, FAILED_PREFIX + NEVER_CONTACTED.format(at=at)
        cvm.updated_at = now
        session.add(cvm)
        marked.append(cvm_id)
    return marked


def refusal_target(session: Session, token: str) -> tuple[str, str]:
    """(team, cvm id) to audit a refusal under; unknown tokens are audited without a team."""
    row = session.get(CvmEnrollment, token_digest(token))
    cvm = session.get(Cvm, row.cvm_id) if row is not None else None
    return (cvm.team, cvm.id) if cvm is not None else ("-", "-")


@dataclass(frozen=True)
class Verified:
    """Evidence that verified against the token's CVM, not yet redeemed."""

    cvm_id: str
    public_key: bytes
    events: list[Event] | None


def verify(
    session: Session,
    verifiers: Mapping[str, AttestedReleaseVerifier],
    key: bytes,
    evidence: EnrollEvidence,
) -> Verified:
    """Check the token, nonce and quote; reads only, so it runs outside any write transaction
    (a slow quote verification holds no lock). Raises EnrollmentRefused."""
    _row, cvm = _live(session, evidence.token)
    if not nonce_valid(key, evidence.token, evidence.nonce):
        raise EnrollmentRefused(RefusalReason.wrong_nonce)
    verifier = verifiers.get(cvm.kind)
    if verifier is None:
        raise EnrollmentRefused(
            RefusalReason.no_release_policy, f"no release policy for {cvm.kind} CVMs"
        )
    try:
        public = base64.b64decode(evidence.public_key, validate=True)
        quote = base64.b64decode(evidence.quote, validate=True)
        events = (
            load_event_log(base64.b64decode(evidence.event_log, validate=True))
            if evidence.event_log is not None
            else None
        )
    except (binascii.Error, AttestError, ValueError) as exc:
        raise EnrollmentRefused(RefusalReason.bad_evidence, str(exc)[:200]) from None
    if len(public) != 32:
        raise EnrollmentRefused(RefusalReason.bad_evidence, "public_key must be 32 bytes")
    verdict = instance_verifier(verifier.verifier, cvm).verify(
        quote, event_log=events, expected_report_data=report_data(evidence.nonce, cvm.id, public)
    )
    if not verdict.ok:
        raise EnrollmentRefused(RefusalReason.attestation_failed, "; ".join(verdict.reasons)[:300])
    return Verified(cvm_id=cvm.id, public_key=public, events=events)


def redeem(session: Session, verified: Verified, evidence: EnrollEvidence) -> tuple[str, bytes]:
    """Spend the token and issue: returns (cvm id, HPKE-sealed credential). The conditional
    UPDATE is the single-use decision: one transaction sees a row change, the others none.
    Call inside a write transaction holding the CVM's lock. Raises EnrollmentRefused."""
    now = utcnow()
    spent = session.execute(
        update(CvmEnrollment)
        .where(col(CvmEnrollment.token_sha256) == token_digest(evidence.token))
        .where(col(CvmEnrollment.used_at).is_(None))
        .values(used_at=now)
    )
    if spent.rowcount != 1:  # type: ignore[attr-defined]
        _live(session, evidence.token)  # raises the reason (reused, ...)
        raise EnrollmentRefused(RefusalReason.reused_token)
    cvm = session.get(Cvm, verified.cvm_id)
    if cvm is None or cvm.state == CvmState.destroyed:
        raise EnrollmentRefused(RefusalReason.cvm_gone)
    credential = CREDENTIAL_PREFIXES[cvm.kind] + secrets.token_urlsafe(32)
    cvm.credential_hash = credential_hash(credential)
    # What this launch measured: a later boot of it re-enrolls by a fresh quote (reenrollment).
    reenrollment.record_binding(session, cvm, verified.events)
    failed_to_enroll = cvm.state == CvmState.failed and (cvm.state_reason or "").startswith(
        FAILED_PREFIX
    )
    if cvm.state == CvmState.pending or failed_to_enroll:
        # A registered replica runs once it enrolled; one that failed only for want of
        # enrollment runs again.
        cvm.state, cvm.state_reason = CvmState.running, None
    cvm.updated_at = now
    session.add(cvm)
    audit.append(
        session, actor=f"cvm:{cvm.id}", team=cvm.team, action=AuditAction.cvm_enroll, target=cvm.id,
        details={"kind": cvm.kind},
    )  # fmt: skip
    sealed = seal_release(
        credential.encode(),
        X25519PublicKey.from_public_bytes(verified.public_key),
        hpke_info(cvm.id, evidence.nonce),
    )
    return cvm.id, sealed
