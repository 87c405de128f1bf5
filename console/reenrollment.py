"""Re-enrollment by fresh quote: a CVM that enrolled once gets a new credential after a reboot,
stop/start or re-create, with no token and no operator.

Its services keep their credentials on tmpfs (Docker volumes under /var/lib/docker, which the
verity-rooted image mounts as tmpfs), and enrollment tokens are single-use, so without this every
restart failed closed. What stands in for the token is the CVM's measured launch:

- At a token enrollment the Console records the **launch binding**: the launch-bound RTMR3
  events (`contracts.enrollment.LAUNCH_BOUND_EVENTS`: compose hash, CVM id, SSH keys digest, host
  ruleset digest) of the event log that replayed against the verified quote.
- A renewal asks a single-use nonce for its CVM id (`renew_challenge`), then presents a quote of
  the CVM's release binding `SHA-512("umbra-renew-v1\\0" ‖ nonce ‖ \\0 ‖ cvm_id ‖ \\0 ‖ key)` and the
  event log. The Console verifies it exactly as an enrollment (the release's golden values,
  collateral, replay), then requires the log's launch binding to **equal** the recorded one: the
  same CVM id, the same compose, keys and ruleset. Only then it issues a fresh credential,
  HPKE-sealed to the bound key, replacing (revoking) the old one; audited `cvm.reenroll`.
- Refusals (no or wrong nonce, bad evidence, a quote that fails, another launch) are audited
  `cvm.reenroll_refused` with the reason and change nothing: the old credential stays until a
  renewal succeeds. A nonce is spent by any attempt, so a replayed quote is refused.

A CVM without a recorded binding (never enrolled, enrolled before bindings were recorded, or
destroyed) gets `not_enrolled` at the challenge: it needs a token. The challenge also carries the
client's binding digest: when it differs from the recorded one (the CVM was relaunched with new
launch data and a fresh token), the answer is `not_enrolled` too, so the client spends its new
token instead of failing a renewal. That digest is a routing hint only; the quote decides.
"""

from __future__ import annotations

import base64
import binascii
import enum
import secrets
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from pydantic import BaseModel, ConfigDict
from pydantic import Field as PydanticField
from sqlalchemy import JSON, Column, DateTime
from sqlalchemy.orm import Session
from sqlmodel import Field, SQLModel

from umbra.attest.errors import AttestError
from umbra.attest.eventlog import Event, load_event_log
from umbra.attest.launch_binding import LaunchBindingError, launch_binding
from umbra.console import audit
from umbra.console.enums import AuditAction, CvmKind
from umbra.console.instance_policy import instance_verifier
from umbra.console.models import Cvm, utcnow
from umbra.console.release import AttestedReleaseVerifier, seal_release
from umbra.console.services.access import credential_hash
from umbra.contracts.enrollment import (
    SECURITY_CVM_CREDENTIAL_PREFIX,
    TUNNEL_CREDENTIAL_PREFIX,
    launch_binding_sha256,
    renew_hpke_info,
    renew_report_data,
)

NONCE_TTL = timedelta(minutes=2)
_PREFIXES = {
    CvmKind.security: SECURITY_CVM_CREDENTIAL_PREFIX,
    CvmKind.dev: TUNNEL_CREDENTIAL_PREFIX,
}


class RenewalRefusal(enum.StrEnum):
    not_enrolled = "not_enrolled"
    no_challenge = "no_challenge"
    wrong_nonce = "wrong_nonce"
    no_release_policy = "no_release_policy"
    bad_evidence = "bad_evidence"
    attestation_failed = "attestation_failed"
    launch_mismatch = "launch_mismatch"


class RenewalRefused(Exception):
    def __init__(self, reason: RenewalRefusal, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason


class CvmLaunchBinding(SQLModel, table=True):
    """The launch a CVM's token enrollment showed, and its renewal nonce."""

    __tablename__ = "cvm_launch_binding"

    cvm_id: str = Field(primary_key=True, max_length=64)
    events: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    events_sha256: str = Field(max_length=64)
    bound_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
    renewals: int = 0
    renewed_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )
    nonce: str | None = Field(default=None, max_length=64)
    nonce_expires_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )


class RenewChallengeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cvm_id: str = PydanticField(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    launch_sha256: str = PydanticField(pattern=r"^[0-9a-f]{64}$")


class RenewEvidence(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cvm_id: str = PydanticField(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    nonce: str = PydanticField(pattern=r"^[A-Za-z0-9_-]{16,64}$")
    quote: str = PydanticField(max_length=64 << 10, description="Base64 TDX quote.")
    event_log: str = PydanticField(max_length=1 << 20, description="Base64 event log (required).")
    public_key: str = PydanticField(max_length=64, description="Base64 raw X25519 key.")


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=utcnow().tzinfo)


def record_binding(session: Session, cvm: Cvm, events: list[Event] | None) -> bool:
    """At a token enrollment whose quote verified with `events`: remember its launch (replacing
    an earlier launch's). Returns False (nothing recorded, renewal impossible) when the log shows
    no launch or another CVM's id."""
    row = session.get(CvmLaunchBinding, cvm.id)
    try:
        binding = launch_binding(events or [])
    except LaunchBindingError:
        binding = None
    if binding is None or bytes.fromhex(binding["umbra.cvm-id"]) != cvm.id.encode():
        if row is not None:  # an older launch's binding must not outlive this enrollment
            session.delete(row)
        return False
    if row is None:
        row = CvmLaunchBinding(cvm_id=cvm.id, events_sha256="", bound_at=utcnow())
    row.events, row.events_sha256 = binding, launch_binding_sha256(binding)
    row.bound_at, row.renewals, row.renewed_at = utcnow(), 0, None
    row.nonce = row.nonce_expires_at = None
    session.add(row)
    return True


def _bound(session: Session, cvm_id: str) -> tuple[CvmLaunchBinding, Cvm]:
    cvm = session.get(Cvm, cvm_id)
    row = session.get(CvmLaunchBinding, cvm_id)
    if cvm is None or row is None or cvm.state == "destroyed":
        raise RenewalRefused(RenewalRefusal.not_enrolled)
    return row, cvm


def renew_challenge(session: Session, request: RenewChallengeRequest) -> str:
    """A single-use nonce for one renewal of a bound CVM whose launch the client says it has."""
    row, _cvm = _bound(session, request.cvm_id)
    if not secrets.compare_digest(row.events_sha256, request.launch_sha256):
        raise RenewalRefused(RenewalRefusal.not_enrolled, "another launch: enroll with its token")
    row.nonce = secrets.token_urlsafe(24)
    row.nonce_expires_at = utcnow() + NONCE_TTL
    session.add(row)
    return row.nonce


def spend_nonce(session: Session, cvm_id: str) -> tuple[str, str]:
    """After a refusal: the nonce is good for one attempt. Returns (team, cvm id) to audit."""
    row = session.get(CvmLaunchBinding, cvm_id)
    if row is not None:
        row.nonce = row.nonce_expires_at = None
        session.add(row)
    cvm = session.get(Cvm, cvm_id)
    return (cvm.team, cvm.id) if cvm is not None else ("-", "-")


def renew(
    session: Session, verifiers: Mapping[str, AttestedReleaseVerifier], evidence: RenewEvidence
) -> tuple[str, bytes]:
    """Verify and re-issue: returns (cvm id, HPKE-sealed credential). Raises RenewalRefused."""
    row, cvm = _bound(session, evidence.cvm_id)
    if row.nonce is None or row.nonce_expires_at is None:
        raise RenewalRefused(RenewalRefusal.no_challenge)
    if not secrets.compare_digest(row.nonce, evidence.nonce) or (
        _aware(row.nonce_expires_at) < utcnow()
    ):
        raise RenewalRefused(RenewalRefusal.wrong_nonce)
    verifier = verifiers.get(cvm.kind)
    if verifier is None:
        raise RenewalRefused(RenewalRefusal.no_release_policy, f"no release for {cvm.kind} CVMs")
    try:
        key = base64.b64decode(evidence.public_key, validate=True)
        quote = base64.b64decode(evidence.quote, validate=True)
        events = load_event_log(base64.b64decode(evidence.event_log, validate=True))
    except (binascii.Error, AttestError, ValueError) as exc:
        raise RenewalRefused(RenewalRefusal.bad_evidence, str(exc)[:200]) from None
    if len(key) != 32:
        raise RenewalRefused(RenewalRefusal.bad_evidence, "public_key must be 32 bytes")
    verdict = instance_verifier(verifier.verifier, cvm).verify(
        quote, event_log=events, expected_report_data=renew_report_data(row.nonce, cvm.id, key)
    )
    if not verdict.ok:
        raise RenewalRefused(RenewalRefusal.attestation_failed, "; ".join(verdict.reasons)[:300])
    # The log replayed against the verified quote: its launch events are what this TD measured.
    try:
        binding = launch_binding(events)
    except LaunchBindingError as exc:
        raise RenewalRefused(RenewalRefusal.launch_mismatch, str(exc)) from None
    if binding != row.events:
        differ = sorted(
            k for k in set(binding) | set(row.events) if binding.get(k) != row.events.get(k)
        )
        raise RenewalRefused(RenewalRefusal.launch_mismatch, "differs in " + ", ".join(differ))
    credential = _PREFIXES[cvm.kind] + secrets.token_urlsafe(32)
    cvm.credential_hash = credential_hash(credential)  # the old credential stops working here
    cvm.updated_at = utcnow()
    nonce = row.nonce
    row.nonce = row.nonce_expires_at = None
    row.renewals += 1
    row.renewed_at = utcnow()
    session.add_all([cvm, row])
    audit.append(
        session, actor=f"cvm:{cvm.id}", team=cvm.team, action=AuditAction.cvm_reenroll, target=cvm.id,
        details={"kind": cvm.kind, "renewals": row.renewals},
    )  # fmt: skip
    sealed = seal_release(
        credential.encode(), X25519PublicKey.from_public_bytes(key), renew_hpke_info(cvm.id, nonce)
    )
    return cvm.id, sealed
