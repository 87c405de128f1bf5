"""What a Security CVM pulls: its team's signed bundle, the attachments of the Dev CVMs it serves,
and (after attestation) their secrets. Pull only; the Console never pushes to a Security CVM.

A replica (console/security_pool.py) serves its pool: the Dev CVMs routed to the pool's first
Security CVM, whichever replica the load balancer hands them to. Everything else stays per
replica: its credential, its release nonces and quote binding, its audit actor, its records."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from sqlalchemy import delete, func, select, update
from sqlmodel import col
from starlette.concurrency import run_in_threadpool

from umbra.console import audit
from umbra.console.deps import ConsoleDep, SecurityCvmDep, require_same_cvm
from umbra.console.enums import AuditAction, CvmKind, CvmState, Scope, SecretStatus
from umbra.console.envelope import EnvelopeError, Sealed, open_sealed, secret_aad
from umbra.console.longpoll import watch
from umbra.console.models import Cvm, ReleaseNonce, Secret, utcnow
from umbra.console.release import (
    ReleaseEvidence,
    ReleaseRefused,
    describe_suite,
    hpke_info,
    seal_release,
)
from umbra.console.routes.common import CvmIdPath
from umbra.console.schemas import AttachmentsDoc, ReleaseChallenge, ReleaseResponse
from umbra.console.security_pool import pool_id
from umbra.console.services.policy import current_bundle
from umbra.console.state import Console
from umbra.contracts.canonical import canonical_json
from umbra.contracts.release import ReleaseDocument, ReleasedSecret

router = APIRouter(prefix="/api/v1/security-cvms/{cvm_id}", tags=["security-cvm"])
IfNoneMatch = Annotated[str | None, Header(alias="If-None-Match", max_length=1024)]
Wait = Annotated[
    int, Query(ge=0, le=600, description="Long poll: seconds to wait for a change (capped).")
]


@router.get(
    "/bundle",
    summary="The team's current signed bundle (ETag = bundle hash; long poll with ?wait=).",
    responses={
        200: {"content": {"application/json": {}}, "description": "Signed bundle bytes"},
        304: {"description": "Unchanged"},
        404: {"description": "No bundle uploaded yet"},
    },
)
async def get_bundle(
    request: Request,
    cvm_id: CvmIdPath,
    caller: SecurityCvmDep,
    console: ConsoleDep,
    if_none_match: IfNoneMatch = None,
    wait: Wait = 0,
) -> Response:
    require_same_cvm(caller, cvm_id)

    def load() -> tuple[str, int, bytes] | None:
        with console.session() as session:
            row = current_bundle(session, caller.team)
            return None if row is None else (row.hash, row.serial, row.raw)

    # No bundle yet keeps the poll waiting: the first upload answers it.
    watched = await watch(
        console, load, lambda bundle: bundle[0], if_none_match, wait, request.is_disconnected
    )
    if watched.value is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"team {caller.team!r} has no policy bundle")
    _hash, serial, raw = watched.value
    headers = watched.etag_header | {"X-Umbra-Bundle-Serial": str(serial)}
    if watched.unchanged:
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=headers)
    return Response(content=raw, media_type="application/json", headers=headers)


def attachments_document(console: Console, caller: Cvm) -> dict[str, Any]:
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


@router.get(
    "/attachments",
    response_model=AttachmentsDoc,
    summary="Profiles and owners of the Dev CVMs this Security CVM serves (ETag; long poll).",
    responses={304: {"description": "Unchanged"}},
)
async def get_attachments(
    request: Request,
    cvm_id: CvmIdPath,
    caller: SecurityCvmDep,
    console: ConsoleDep,
    response: Response,
    if_none_match: IfNoneMatch = None,
    wait: Wait = 0,
) -> Any:
    require_same_cvm(caller, cvm_id)
    watched = await watch(
        console,
        lambda: attachments_document(console, caller),
        document_etag,
        if_none_match,
        wait,
        request.is_disconnected,
    )
    if watched.unchanged:
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=watched.etag_header)
    response.headers.update(watched.etag_header)
    return AttachmentsDoc.model_validate(watched.value)


def secrets_version(console: Console, caller: Cvm) -> str:
    """A digest of everything a release to `caller` would carry, without any value: which secrets
    (team, and personal of the owners it serves), their versions (bumped on rotation) and hosts."""
    with console.session() as session:
        owners = set(
            session.execute(
                select(col(Cvm.owner)).where(
                    col(Cvm.security_cvm_id) == pool_id(caller),
                    col(Cvm.team) == caller.team,
                    col(Cvm.state) != CvmState.destroyed,
                )
            ).scalars()
        )
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


@router.get(
    "/secrets/version",
    summary="Version of the secrets a release would carry (ETag; long poll with ?wait=; no values).",
    responses={304: {"description": "Unchanged"}},
)
async def get_secrets_version(
    request: Request,
    cvm_id: CvmIdPath,
    caller: SecurityCvmDep,
    console: ConsoleDep,
    if_none_match: IfNoneMatch = None,
    wait: Wait = 0,
) -> Response:
    require_same_cvm(caller, cvm_id)
    watched = await watch(
        console,
        lambda: secrets_version(console, caller),
        lambda v: v,
        if_none_match,
        wait,
        request.is_disconnected,
    )
    if watched.unchanged:
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=watched.etag_header)
    return Response(
        content=json.dumps({"version": watched.value}),
        media_type="application/json",
        headers=watched.etag_header,
    )


@router.post(
    "/release-challenge",
    summary="A single-use nonce to bind into the quote for a secret release.",
)
def release_challenge(
    cvm_id: CvmIdPath, caller: SecurityCvmDep, console: ConsoleDep
) -> ReleaseChallenge:
    require_same_cvm(caller, cvm_id)
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
            raise HTTPException(
                status.HTTP_429_TOO_MANY_REQUESTS,
                "too many release challenges for this Security CVM; retry later",
                headers={"Retry-After": "10"},
            )
        session.execute(
            delete(ReleaseNonce).where(
                col(ReleaseNonce.security_cvm_id) == caller.id,
                col(ReleaseNonce.expires_at) < now,
            )
        )
        session.add(ReleaseNonce(nonce=nonce, security_cvm_id=caller.id, expires_at=expires))
    return ReleaseChallenge(
        nonce=nonce,
        expires_at=expires,
        report_data_rule='SHA-512("umbra-secret-release-v1\\0" || nonce || "\\0" || '
        'security_cvm_id || "\\0" || x25519_public_key)',
    )


@router.post(
    "/secrets/release",
    summary="Release the secrets this Security CVM needs, HPKE-sealed to its attested key.",
    responses={403: {"description": "Evidence refused"}, 503: {"description": "Not configured"}},
)
async def release_secrets(
    cvm_id: CvmIdPath, evidence: ReleaseEvidence, caller: SecurityCvmDep, console: ConsoleDep
) -> ReleaseResponse:
    require_same_cvm(caller, cvm_id)
    return await run_in_threadpool(_release, console, caller, evidence)


def _release(console: Console, caller: Cvm, evidence: ReleaseEvidence) -> ReleaseResponse:
    verifier, keyring = console.release_verifier, console.keyring
    if verifier is None or keyring is None:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, "attested secret release is not configured"
        )
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
            raise HTTPException(status.HTTP_403_FORBIDDEN, "nonce: unknown, used or expired")
    try:
        recipient = verifier.verify(evidence, caller.id)
    except ReleaseRefused as exc:
        console.metrics.secret_releases.labels("refused").inc()
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(exc)) from None
    with console.write() as session:
        owners = set(
            session.execute(
                select(col(Cvm.owner)).where(
                    col(Cvm.security_cvm_id) == pool_id(caller),
                    col(Cvm.team) == caller.team,
                    col(Cvm.state) != CvmState.destroyed,
                )
            ).scalars()
        )
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
                raise HTTPException(
                    status.HTTP_409_CONFLICT, f"secret {row.scope}/{row.name}: {exc}"
                ) from None
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
