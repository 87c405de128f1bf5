"""What a Security CVM pulls, HTTP-free: its team's current bundle, the attachments document of
the Dev CVMs its pool serves, the version of the secrets a release would carry, release
challenges (rate limited in the database) and the attested, HPKE-sealed secret release."""

from __future__ import annotations

import base64
import hashlib
import secrets
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console import audit
from umbra.console.enums import AuditAction, CvmKind, CvmState, Scope, SecretStatus
from umbra.console.envelope import EnvelopeError, Sealed, open_sealed, secret_aad
from umbra.console.models import Cvm, ReleaseNonce, Secret, utcnow
from umbra.console.release import (
    ReleaseEvidence,
    ReleaseRefused,
    describe_suite,
    hpke_info,
    seal_release,
)
from umbra.console.schemas import ReleaseChallenge, ReleaseResponse
from umbra.console.security_pool import pool_id
from umbra.console.services.errors import Conflict, Forbidden, RateLimited, Unavailable
from umbra.console.services.policy import current_bundle
from umbra.console.state import Console
from umbra.contracts.canonical import canonical_json
from umbra.contracts.release import ReleaseDocument, ReleasedSecret

REPORT_DATA_RULE = (
    'SHA-512("umbra-secret-release-v1\\0" || nonce || "\\0" || '
    'security_cvm_id || "\\0" || x25519_public_key)'
)


def bundle(*, console: Console, team: str) -> tuple[str, int, bytes] | None:
    """The team's current bundle as (hash, serial, raw), or None before the first upload."""
    with console.session() as session:
        row = current_bundle(session, team)
        return None if row is None else (row.hash, row.serial, row.raw)


def attachments_document(*, console: Console, caller: Cvm) -> dict[str, Any]:
    with console.session() as session:
        rows = session.execute(
            select(Cvm)
            .where(
                col(Cvm.security_cvm_id) == pool_id(caller),
                col(Cvm.team) == caller.team,
                col(Cvm.kind) == CvmKind.dev,
                col(Cvm.state) != CvmState.destroyed,
            )
            .order_by(col(Cvm.id))
        ).scalars()
        return {
            "cvms": {
                row.id: {
                    "owner": row.owner,
                    "team": row.team,
                    "profiles": sorted(row.profiles),
                    # The tunnel credential's hash once the Dev CVM has enrolled (only then does
                    # the tunnel endpoint let it in); never the credential itself.
                    "credential_sha256": row.credential_hash,
                }
                for row in rows
            }
        }


def document_etag(document: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(document, ascii_only=True)).hexdigest()


def served_owners(session: Session, caller: Cvm) -> set[str]:
    """Owners of the live CVMs routed to the caller's pool (whose personal secrets it gets)."""
    return set(
        session.execute(
            select(col(Cvm.owner)).where(
                col(Cvm.security_cvm_id) == pool_id(caller),
                col(Cvm.team) == caller.team,
                col(Cvm.state) != CvmState.destroyed,
            )
        ).scalars()
    )


def secrets_version(*, console: Console, caller: Cvm) -> str:
    """A digest of everything a release to `caller` would carry, without any value: which secrets
    (team, and personal of the owners it serves), their versions (bumped on rotation) and hosts."""
    with console.session() as session:
        owners = served_owners(session, caller)
        rows = session.execute(
            select(
                col(Secret.id),
                col(Secret.scope),
                col(Secret.owner),
                col(Secret.name),
                col(Secret.version),
                col(Secret.hosts),
                col(Secret.status),
            ).where(col(Secret.team) == caller.team)
        ).all()
    items = sorted(
        [str(row_id), scope, owner or "", name, int(version), sorted(hosts or []), str(status)]
        for row_id, scope, owner, name, version, hosts, status in rows
        if scope != Scope.personal or owner in owners
    )
    return document_etag({"secrets": items})


def release_challenge(*, console: Console, caller: Cvm) -> ReleaseChallenge:
    now = utcnow()
    nonce = secrets.token_urlsafe(32)
    ttl = timedelta(seconds=console.settings.release_nonce_ttl_seconds)
    expires = now + ttl
    # Rate limited per Security CVM in the database (so across workers): nonces issued in the
    # last minute are those expiring later than one minute before a fresh one would.
    with console.write(f"release-challenge:{caller.id}") as session:
        recent = session.execute(
            select(func.count())
            .select_from(ReleaseNonce)
            .where(
                col(ReleaseNonce.security_cvm_id) == caller.id,
                col(ReleaseNonce.expires_at) > expires - timedelta(seconds=60),
            )
        ).scalar_one()
        if recent >= console.settings.release_challenges_per_minute:
            raise RateLimited(
                "too many release challenges for this Security CVM; retry later", retry_after=10
            )
        session.execute(
            delete(ReleaseNonce).where(
                col(ReleaseNonce.security_cvm_id) == caller.id,
                col(ReleaseNonce.expires_at) < now,
            )
        )
        session.add(ReleaseNonce(nonce=nonce, security_cvm_id=caller.id, expires_at=expires))
    return ReleaseChallenge(nonce=nonce, expires_at=expires, report_data_rule=REPORT_DATA_RULE)


def release(*, console: Console, caller: Cvm, evidence: ReleaseEvidence) -> ReleaseResponse:
    verifier, keyring = console.release_verifier, console.keyring
    if verifier is None or keyring is None:
        raise Unavailable("attested secret release is not configured")
    with console.write() as session:  # consume the nonce first: single use even on failure
        consumed = session.execute(
            update(ReleaseNonce)
            .where(
                col(ReleaseNonce.nonce) == evidence.nonce,
                col(ReleaseNonce.security_cvm_id) == caller.id,
                col(ReleaseNonce.used) == False,  # noqa: E712
                col(ReleaseNonce.expires_at) > utcnow(),
            )
            .values(used=True)
            .returning(col(ReleaseNonce.nonce))
        ).first()
        if consumed is None:
            console.metrics.secret_releases.labels("refused").inc()
            raise Forbidden("nonce: unknown, used or expired")
    try:
        recipient = verifier.verify(evidence, caller.id)
    except ReleaseRefused as exc:
        console.metrics.secret_releases.labels("refused").inc()
        raise Forbidden(str(exc)) from None
    with console.write() as session:
        owners = served_owners(session, caller)
        rows = list(
            session.execute(select(Secret).where(col(Secret.team) == caller.team)).scalars()
        )
        released = []
        for row in rows:
            if row.scope == Scope.personal and row.owner not in owners:
                continue
            aad = secret_aad(row.team, row.scope, row.owner, row.name, row.version)
            try:
                value = open_sealed(
                    keyring, Sealed(row.kek_id, row.wrapped_key, row.ciphertext), aad
                )
            except EnvelopeError as exc:
                raise Conflict(f"secret {row.scope}/{row.name}: {exc}") from None
            released.append(
                {
                    "ref": f"{row.scope}/{row.name}",
                    "owner": row.owner or None,
                    "hosts": list(row.hosts),
                    "version": row.version,
                    "kind": row.kind,
                    "needs_login": row.status == SecretStatus.needs_login,
                    "value": base64.b64encode(value).decode(),
                }
            )
        audit.append(
            session,
            actor=f"security-cvm:{caller.id}",
            team=caller.team,
            action=AuditAction.secret_release,
            target=caller.id,
            details={"refs": sorted(f"{item['ref']}@{item['owner'] or ''}" for item in released)},
        )
    # The proxy parses exactly this model (umbra.contracts.release), so build it from it too.
    document = (
        ReleaseDocument(
            security_cvm_id=caller.id,
            nonce=evidence.nonce,
            secrets=[ReleasedSecret.model_validate(item) for item in released],
        )
        .model_dump_json()
        .encode()
    )
    info = hpke_info(caller.id, evidence.nonce)
    sealed = seal_release(document, recipient, info)
    console.metrics.secret_releases.labels("released").inc()
    return ReleaseResponse(
        suite=list(describe_suite()),
        info=base64.b64encode(info).decode(),
        sealed=base64.b64encode(sealed).decode(),
        count=len(released),
    )
