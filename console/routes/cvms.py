"""CVMs: register, list, update and destroy through provider adapters; attach profiles."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import replace
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, status
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console import audit, enrollment, provisioning, security_pool, team_defaults
from umbra.console.deps import (
    CREDENTIAL_PREFIX,
    ConsoleDep,
    UserDep,
    credential_hash,
    require_role,
)
from umbra.console.models import Cvm, utcnow
from umbra.console.providers import (
    CvmProvider,
    CvmSpec,
    ProviderError,
    ProviderEvent,
    ProviderUnsupported,
)
from umbra.console.provisioning_defaults import default_security_cvm
from umbra.console.routes.common import (
    CvmIdPath,
    TeamPath,
    check_profiles_compose,
    cvm_info,
    cvm_lock,
    not_found,
    policy_lock,
    visible_cvm,
)
from umbra.console.schemas import (
    CvmCreate,
    CvmCreated,
    CvmInfo,
    CvmUpdate,
    ProfilesUpdate,
    profiles_etag,
)

router = APIRouter(prefix="/api/v1", tags=["cvms"])
UNPROCESSABLE = status.HTTP_422_UNPROCESSABLE_CONTENT


def _security_cvm_in_team(session: Session, team: str, cvm_id: str) -> Cvm:
    target = session.get(Cvm, cvm_id)
    if (
        target is None
        or target.team != team
        or target.kind != "security"
        or target.state == "destroyed"
    ):
        raise HTTPException(
            UNPROCESSABLE, f"security_cvm_id: no live Security CVM {cvm_id} in team {team!r}"
        )
    if target.replica_of is not None:
        # Dev CVMs route to a pool, never to one replica (the load balancer picks the replica).
        raise HTTPException(
            UNPROCESSABLE,
            f"security_cvm_id: {cvm_id} is a replica; route to its pool {target.replica_of}",
        )
    return target


@router.post(
    "/teams/{team}/cvms",
    status_code=status.HTTP_201_CREATED,
    summary="Launch a CVM (admin: any; developer: own Dev CVMs).",
)
def create_cvm(team: TeamPath, body: CvmCreate, console: ConsoleDep, user: UserDep) -> CvmInfo:
    role = require_role(user, team, "admin", "developer")
    if body.kind == "security" and role != "admin":
        raise HTTPException(status.HTTP_403_FORBIDDEN, "only admins launch Security CVMs")
    owner = body.owner or user.subject
    if owner != user.subject and role != "admin":
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, "owner: developers launch CVMs for themselves"
        )
    provider = console.providers.get(body.provider)
    if provider is None:
        raise HTTPException(UNPROCESSABLE, f"provider: {body.provider!r} is not configured")
    if body.kind == "security" and body.security_cvm_id is not None:
        raise HTTPException(UNPROCESSABLE, "security_cvm_id: only Dev CVMs route through one")
    cvm_id = "cvm_" + secrets.token_hex(8)
    spec = CvmSpec(
        id=cvm_id,
        team=team,
        name=body.name,
        kind=body.kind,
        owner=owner,
        ssh_keys=tuple(body.ssh_keys),
        size=body.size,
    )
    try:
        provider.check(spec)
    except ProviderError as exc:
        raise HTTPException(UNPROCESSABLE, f"provider: {exc}") from None
    locks = [f"cvm-name:{team}:{owner}:{body.name}"]
    if body.kind == "dev":
        locks.append(policy_lock(team))  # gets exactly the defaults committed before it
    if body.security_cvm_id is not None:
        locks.append(cvm_lock(body.security_cvm_id))  # not destroyed while we route through it
    with console.write(*locks) as session:
        security_cvm_id = body.security_cvm_id
        if security_cvm_id is not None:
            _security_cvm_in_team(session, team, security_cvm_id)
        elif body.kind == "dev":
            security_cvm_id = default_security_cvm(session, team)
        taken = session.execute(
            select(col(Cvm.id)).where(
                col(Cvm.team) == team, col(Cvm.owner) == owner, col(Cvm.name) == body.name
            )
        ).first()
        if taken is not None:
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"name: {owner!r} already has a CVM {body.name!r}"
            )
        profiles = team_defaults.default_profiles(session, team) if body.kind == "dev" else []
        cvm = Cvm(
            id=cvm_id,
            team=team,
            name=body.name,
            kind=body.kind,
            owner=owner,
            provider=body.provider,
            state="launching" if provider.background else "running",
            security_cvm_id=security_cvm_id,
            profiles=profiles,
            ssh_keys=list(body.ssh_keys),
            size=body.size,
            created_by=user.subject,
        )
        session.add(cvm)
        try:
            # Flushed here, not by autoflush inside the audit append, so a unique violation
            # (should the lock ever be bypassed) is this request's 409, not a 500.
            session.flush()
        except IntegrityError:
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"name: {owner!r} already has a CVM {body.name!r}"
            ) from None
        audit.append(
            session,
            actor=user.subject,
            team=team,
            action="cvm.launch",
            target=cvm_id,
            details={
                "name": body.name,
                "kind": body.kind,
                "owner": owner,
                "provider": body.provider,
            },
        )
        team_defaults.audit_attached(
            session, actor=user.subject, team=team, cvm_id=cvm_id, profiles=profiles
        )
        session.flush()
        # Credentials only after attestation: launch data carries this one-time token, the
        # booted CVM enrolls with it (routes/enroll.py). A Security CVM is booted by its team
        # stack or `umbra up`, which mint its token themselves (POST .../enrollment-token).
        token = None
        if body.kind == "dev":
            token, _expires = enrollment.issue_token(session, cvm, user.subject)
        launch_spec = replace(spec, enrollment_token=token)
        if not provider.background:
            launched = _call(lambda: provider.launch(launch_spec, _ignore))
            # A synchronous provider's facts are kept like a background run's (provisioning).
            cvm.provider_ref, cvm.provider_state = launched.ref, launched.state
            session.add(cvm)
            session.flush()
        info = cvm_info(cvm)
    # Committed: a cloud launch now runs outside the transaction and records its own outcome.
    if provider.background:
        provisioning.submit(console, provider, "launch", cvm, enrollment_token=token)
    console.notifier.notify()
    return info


def _ignore(_event: ProviderEvent) -> None:
    """Synchronous (local) providers report nothing worth keeping."""


def _call[T](action: Callable[[], T]) -> T:
    """Run a synchronous provider call: refusals are 422, failures 502, both with its message."""
    try:
        return action()
    except ProviderUnsupported as exc:
        raise HTTPException(UNPROCESSABLE, f"provider: {exc}") from None
    except ProviderError as exc:
        raise HTTPException(status.HTTP_502_BAD_GATEWAY, f"provider: {exc}") from None


def _not_busy(cvm: Cvm) -> None:
    if cvm.state in provisioning.BUSY_STATES:
        raise HTTPException(
            status.HTTP_409_CONFLICT, f"CVM {cvm.id} is {cvm.state}; wait for it to finish"
        )


@router.get("/teams/{team}/cvms", summary="List CVMs (admin: all of the team; developer: own).")
def list_cvms(
    team: TeamPath,
    console: ConsoleDep,
    user: UserDep,
    include_destroyed: Annotated[bool, Query()] = False,
) -> list[CvmInfo]:
    role = require_role(user, team, "admin", "developer")
    query = select(Cvm).where(col(Cvm.team) == team)
    if role != "admin":
        query = query.where(col(Cvm.owner) == user.subject)
    if not include_destroyed:
        query = query.where(col(Cvm.state) != "destroyed")
    with console.session() as session:
        rows = session.execute(query.order_by(col(Cvm.created_at), col(Cvm.id))).scalars()
        return [cvm_info(row) for row in rows]


@router.get("/cvms/{cvm_id}", summary="One CVM (admin of its team, or its owner).")
def get_cvm(cvm_id: CvmIdPath, console: ConsoleDep, user: UserDep) -> CvmInfo:
    with console.session() as session:
        return cvm_info(visible_cvm(session, user, cvm_id))


def _may_manage(cvm: Cvm, role: str | None) -> None:
    if role != "admin" and cvm.kind != "dev":
        raise HTTPException(status.HTTP_403_FORBIDDEN, "only admins manage Security CVMs")


@router.patch("/cvms/{cvm_id}", summary="Start/stop, re-route, or change SSH keys/size.")
def update_cvm(cvm_id: CvmIdPath, body: CvmUpdate, console: ConsoleDep, user: UserDep) -> CvmInfo:
    background: tuple[CvmProvider, Cvm, provisioning.Operation] | None = None
    update_token: str | None = None
    locks = [cvm_lock(cvm_id)]
    if body.security_cvm_id is not None:
        locks.append(cvm_lock(body.security_cvm_id))
    with console.write(*locks) as session:
        cvm = visible_cvm(session, user, cvm_id)
        role = user.role_in(cvm.team)
        _may_manage(cvm, role)
        if cvm.state == "destroyed":
            raise HTTPException(status.HTTP_409_CONFLICT, f"CVM {cvm_id} is destroyed")
        _not_busy(cvm)
        changes: dict[str, object] = {}
        if body.security_cvm_id is not None:
            if role != "admin":
                raise HTTPException(status.HTTP_403_FORBIDDEN, "only admins re-route Dev CVMs")
            if cvm.kind != "dev":
                raise HTTPException(
                    UNPROCESSABLE, "security_cvm_id: only Dev CVMs route through one"
                )
            _security_cvm_in_team(session, cvm.team, body.security_cvm_id)
            cvm.security_cvm_id = body.security_cvm_id
            changes["security_cvm_id"] = body.security_cvm_id
        provider = console.providers.get(cvm.provider)
        wants_provider = (body.state is not None and body.state != cvm.state) or (
            body.ssh_keys is not None or body.size is not None
        )
        if wants_provider and cvm.provider == security_pool.TEAM_STACK_PROVIDER:
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                f"CVM {cvm_id} is run by its team stack: change it there (`pulumi up`)",
            )
        if wants_provider and provider is None:
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"provider {cvm.provider!r} is no longer configured"
            )
        if body.ssh_keys is not None or body.size is not None:
            assert provider is not None
            if body.state is not None:
                raise HTTPException(UNPROCESSABLE, "state: change it in a separate request")
            cvm.ssh_keys = list(body.ssh_keys) if body.ssh_keys is not None else cvm.ssh_keys
            cvm.size = body.size if body.size is not None else cvm.size
            spec = provisioning.spec_of(cvm)
            _call(lambda: provider.check(spec))
            changes["launch_inputs"] = {"ssh_keys": len(cvm.ssh_keys), "size": cvm.size}
            if provider.background:
                cvm.state, cvm.state_reason = "updating", None
                background = (provider, cvm, "update")
                if cvm.kind == "dev":
                    # New launch data may replace the VM (Azure custom data): it gets a fresh
                    # one-time token; a VM kept in place holds its credential and ignores it.
                    update_token, _expires = enrollment.issue_token(session, cvm, user.subject)
            else:
                updated = _call(lambda: provider.update(spec, cvm.provider_ref or "", _ignore))
                cvm.provider_ref, cvm.provider_state = updated.ref, updated.state
        if body.state is not None and body.state != cvm.state:
            assert provider is not None
            if cvm.state == "failed":
                raise HTTPException(
                    status.HTTP_409_CONFLICT, f"CVM {cvm_id} failed; update or destroy it"
                )
            running = body.state == "running"
            if provider.background:
                # A cloud stop/start takes minutes: the provisioning worker runs it and records
                # `running`/`stopped` (or `failed` with the reason), never this request.
                if not cvm.provider_ref:
                    raise HTTPException(
                        status.HTTP_409_CONFLICT,
                        f"CVM {cvm_id} has no provider resource to "
                        "stop or start; update or destroy it",
                    )
                cvm.state, cvm.state_reason = "updating", None
                background = (provider, cvm, "start" if running else "stop")
            else:
                _call(lambda: provider.set_running(cvm.provider_ref or "", running))
                cvm.state = body.state
            changes["state"] = body.state
        if changes:
            cvm.updated_at = utcnow()
            session.add(cvm)
            audit.append(
                session,
                actor=user.subject,
                team=cvm.team,
                action="cvm.update",
                target=cvm.id,
                details=changes,
            )
        session.flush()
        info = cvm_info(cvm)
    if background is not None:
        provisioning.submit(
            console, background[0], background[2], background[1], enrollment_token=update_token
        )
    console.notifier.notify()
    return info


@router.delete("/cvms/{cvm_id}", summary="Destroy a CVM (admin, or the owner of a Dev CVM).")
def destroy_cvm(cvm_id: CvmIdPath, console: ConsoleDep, user: UserDep) -> CvmInfo:
    background: tuple[CvmProvider, Cvm] | None = None
    with console.write(cvm_lock(cvm_id)) as session:
        cvm = visible_cvm(session, user, cvm_id)
        _may_manage(cvm, user.role_in(cvm.team))
        if cvm.state != "destroyed":
            _not_busy(cvm)
            replicas: list[Cvm] = []
            if cvm.kind == "security":
                # Serialized with replica registrations: none joins a pool being destroyed.
                console.lock(session, security_pool.pool_lock(cvm.team))
                replicas = security_pool.live_replicas(session, cvm.id)
            if replicas:
                # Its replicas serve the Dev CVMs routed to it: the pool goes replica by replica.
                raise HTTPException(
                    status.HTTP_409_CONFLICT,
                    f"CVM {cvm_id} leads a Security CVM pool; destroy its replicas first: "
                    + ", ".join(sorted(r.id for r in replicas)),
                )
            provider = console.providers.get(cvm.provider)
            final = "destroyed"
            if provider is not None and provider.background:
                final, background = "destroying", (provider, cvm)
            elif provider is not None and cvm.provider_ref:
                spec = provisioning.spec_of(cvm)
                _call(lambda: provider.destroy(spec, cvm.provider_ref, _ignore))
            # Routing, attachments and the credential end now, whatever the cloud run does.
            cvm.state = final
            cvm.state_reason = None
            cvm.credential_hash = None
            cvm.profiles = []
            cvm.updated_at = utcnow()
            session.add(cvm)
            audit.append(
                session,
                actor=user.subject,
                team=cvm.team,
                action="cvm.destroy",
                target=cvm.id,
                details={},
            )
        session.flush()
        info = cvm_info(cvm)
    if background is not None:
        provisioning.submit(console, background[0], "destroy", background[1])
    console.notifier.notify()
    return info


@router.put("/cvms/{cvm_id}/profiles", summary="Attach policy profiles to a Dev CVM (admin).")
def attach_profiles(
    cvm_id: CvmIdPath,
    body: ProfilesUpdate,
    console: ConsoleDep,
    user: UserDep,
    if_match: Annotated[
        str | None,
        Header(
            alias="If-Match",
            max_length=128,
            description="Attach only if the attachments are still this version (else 412).",
        ),
    ] = None,
) -> CvmInfo:
    profiles = sorted(set(body.profiles))
    with console.write(cvm_lock(cvm_id)) as session:
        cvm = visible_cvm(session, user, cvm_id)
        require_role(user, cvm.team, "admin")
        console.lock(session, policy_lock(cvm.team))  # after the CVM lock, as everywhere
        if cvm.kind != "dev":
            raise HTTPException(UNPROCESSABLE, "profiles: attach profiles to Dev CVMs only")
        if cvm.state == "destroyed":
            raise HTTPException(status.HTTP_409_CONFLICT, f"CVM {cvm_id} is destroyed")
        if if_match is not None and if_match.strip('" ') != profiles_etag(cvm.profiles):
            raise HTTPException(
                status.HTTP_412_PRECONDITION_FAILED,
                f"CVM {cvm_id}'s attachments changed since you read them; read and retry",
            )
        check_profiles_compose(console, session, cvm.team, profiles)
        cvm.profiles = profiles
        cvm.updated_at = utcnow()
        session.add(cvm)
        audit.append(
            session,
            actor=user.subject,
            team=cvm.team,
            action="profiles.attach",
            target=cvm.id,
            details={"profiles": profiles},
        )
        session.flush()
        info = cvm_info(cvm)
    console.notifier.notify()
    return info


@router.post(
    "/cvms/{cvm_id}/credential",
    summary="Issue a new credential for a Security CVM, revoking the old one (admin).",
)
def rotate_credential(cvm_id: CvmIdPath, console: ConsoleDep, user: UserDep) -> CvmCreated:
    # Serialized per CVM: of concurrent rotations, the one that commits last holds the only
    # working credential, and every earlier one is revoked by it.
    with console.write(cvm_lock(cvm_id)) as session:
        cvm = visible_cvm(session, user, cvm_id)
        require_role(user, cvm.team, "admin")
        if cvm.kind != "security" or cvm.state == "destroyed":
            raise not_found(f"live Security CVM {cvm_id}")
        credential = CREDENTIAL_PREFIX + secrets.token_urlsafe(32)
        cvm.credential_hash = credential_hash(credential)
        cvm.updated_at = utcnow()
        session.add(cvm)
        audit.append(
            session,
            actor=user.subject,
            team=cvm.team,
            action="cvm.credential",
            target=cvm.id,
            # Issued without attestation: the audit says so, whoever reads it later.
            details={"break_glass": True},
        )
        session.flush()
        info = cvm_info(cvm)
    return CvmCreated(**info.model_dump(), credential=credential)
