"""CVM lifecycle: launch, list, update, destroy, attach profiles, rotate a Security CVM credential.

Each write checks the caller's role, takes the CVM's (and where it matters the team policy's)
lock, changes the row and appends its audit entry in one transaction; a cloud provider's run is
handed to `provisioning` only after that commits.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.attest.session_info import SessionInfo
from umbra.console import audit, enrollment, provisioning, security_pool
from umbra.console.enums import AuditAction, CvmKind, CvmState, Operation, Power, Role
from umbra.console.models import Cvm, utcnow
from umbra.console.providers import (
    CvmProvider,
    CvmSpec,
    ProviderError,
    ProviderEvent,
    ProviderUnsupported,
)
from umbra.console.provisioning_defaults import default_security_cvm
from umbra.console.schemas import CvmCreate, CvmCreated, CvmInfo, CvmUpdate, profiles_etag
from umbra.console.services import team_defaults, team_quotas
from umbra.console.services.access import (
    CREDENTIAL_PREFIX,
    User,
    credential_hash,
    cvm_lock,
    member,
    policy_lock,
    require_role,
    visible_cvm,
)
from umbra.console.services.errors import (
    Conflict,
    Forbidden,
    Invalid,
    ProviderFailed,
    Stale,
    not_found,
)
from umbra.console.services.policy import check_profiles_compose
from umbra.console.session_info import session_info
from umbra.console.state import Console
from umbra.contracts.agent_logins import SELF_SERVICE_PROFILES


def cvm_info(cvm: Cvm) -> CvmInfo:
    internal = {"credential_hash", "created_by", "lease_owner", "lease_until"}
    return CvmInfo.model_validate(cvm.model_dump(exclude=internal))


def _security_cvm_in_team(session: Session, team: str, cvm_id: str) -> Cvm:
    target = session.get(Cvm, cvm_id)
    if (
        target is None
        or target.team != team
        or target.kind != CvmKind.security
        or target.state == CvmState.destroyed
    ):
        raise Invalid(f"security_cvm_id: no live Security CVM {cvm_id} in team {team!r}")
    if target.replica_of is not None:
        # Dev CVMs route to a pool, never to one replica (the load balancer picks the replica).
        raise Invalid(
            f"security_cvm_id: {cvm_id} is a replica; route to its pool {target.replica_of}"
        )
    return target


def _name_taken(owner: str, name: str) -> Conflict:
    return Conflict(f"name: {owner!r} already has a CVM {name!r}")


def launch(*, console: Console, user: User, team: str, request: CvmCreate) -> CvmInfo:
    """Record a new CVM (and its audit entries) and launch it: a synchronous provider now, a
    cloud one in the background after the commit."""
    role = member(user, team)
    if request.kind == CvmKind.security and role != Role.admin:
        raise Forbidden("only admins launch Security CVMs")
    owner = request.owner or user.subject
    if owner != user.subject and role != Role.admin:
        raise Forbidden("owner: developers launch CVMs for themselves")
    provider = console.providers.get(request.provider)
    if provider is None:
        raise Invalid(f"provider: {request.provider!r} is not configured")
    if request.kind == CvmKind.security and request.security_cvm_id is not None:
        raise Invalid("security_cvm_id: only Dev CVMs route through one")
    dev = request.kind == CvmKind.dev
    if not dev and request.data_disk_gb is not None:
        raise Invalid("data_disk_gb: only Dev CVMs are launched with a data disk size")
    # The size recorded (and counted by the disk quotas) is the size the provider creates.
    data_disk_gb = request.data_disk_gb
    if dev and data_disk_gb is None:
        data_disk_gb = provider.default_data_disk_gb
    cvm_id = "cvm_" + secrets.token_hex(8)
    spec = CvmSpec(
        id=cvm_id,
        team=team,
        name=request.name,
        kind=request.kind,
        owner=owner,
        ssh_keys=tuple(request.ssh_keys),
        size=request.size,
        data_disk_gb=data_disk_gb,
    )
    try:
        provider.check(spec)
    except ProviderError as exc:
        raise Invalid(f"provider: {exc}") from None
    locks = [f"cvm-name:{team}:{owner}:{request.name}"]
    if request.kind == CvmKind.dev:
        locks.append(policy_lock(team))  # gets exactly the defaults committed before it
    if request.security_cvm_id is not None:
        locks.append(cvm_lock(request.security_cvm_id))  # not destroyed while we route through it
    try:
        info, cvm, token = _launch_row(console, user, team, request, spec, provider, locks)
    except team_quotas.QuotaRefused as refused:
        team_quotas.audit_refusal(
            console, user, refused, operation="launch", target=f"{owner}/{request.name}"
        )
        raise
    # Committed: a cloud launch now runs outside the transaction and records its own outcome.
    if provider.background:
        provisioning.submit(console, provider, Operation.launch, cvm, enrollment_token=token)
    console.notifier.notify()
    return info


def _launch_row(
    console: Console,
    user: User,
    team: str,
    request: CvmCreate,
    spec: CvmSpec,
    provider: CvmProvider,
    locks: list[str],
) -> tuple[CvmInfo, Cvm, str | None]:
    """The launch's transaction: the row, its audit entries and a synchronous provider's run."""
    owner, cvm_id, dev = spec.owner, spec.id, spec.kind == CvmKind.dev
    with console.write(*locks) as session:
        security_cvm_id = request.security_cvm_id
        if security_cvm_id is not None:
            _security_cvm_in_team(session, team, security_cvm_id)
        elif request.kind == CvmKind.dev:
            security_cvm_id = default_security_cvm(session, team)
        taken = session.execute(
            select(col(Cvm.id)).where(
                col(Cvm.team) == team, col(Cvm.owner) == owner, col(Cvm.name) == request.name
            )
        ).first()
        if taken is not None:
            raise _name_taken(owner, request.name)
        if dev:
            team_quotas.check_launch(
                session, team, owner, request.size, spec.data_disk_gb,
                default_disk=request.data_disk_gb is None,
            )  # fmt: skip
        profiles = team_defaults.default_profiles(session, team) if dev else []
        cvm = Cvm(
            id=cvm_id,
            team=team,
            name=request.name,
            kind=request.kind,
            owner=owner,
            provider=request.provider,
            state=CvmState.launching if provider.background else CvmState.running,
            security_cvm_id=security_cvm_id,
            profiles=profiles,
            ssh_keys=list(request.ssh_keys),
            size=request.size,
            data_disk_gb=spec.data_disk_gb,
            created_by=user.subject,
        )
        session.add(cvm)
        try:
            # Flushed here, not by autoflush inside the audit append, so a unique violation
            # (should the lock ever be bypassed) is this request's 409, not a 500.
            session.flush()
        except IntegrityError:
            raise _name_taken(owner, request.name) from None
        audit.append(
            session,
            actor=user.subject,
            team=team,
            action=AuditAction.cvm_launch,
            target=cvm_id,
            details={
                "name": request.name,
                "kind": request.kind,
                "owner": owner,
                "provider": request.provider,
                "data_disk_gb": spec.data_disk_gb,
            },
        )
        team_defaults.audit_attached(
            session, actor=user.subject, team=team, cvm_id=cvm_id, profiles=profiles
        )
        session.flush()
        # Credentials only after attestation: launch data carries this one-time token, the
        # booted CVM enrolls with it (routes/enroll.py). A Security CVM is booted by its team
        # stack or `umbra up`, which mint its token themselves (POST .../enrollment-token),
        # unless the provider boots it (a background one: the emulated clouds' `qemu`; the
        # cloud providers refuse Security CVMs in `check`).
        token = None
        if dev or provider.background:
            token, _expires = enrollment.issue_token(session, cvm, user.subject)
        launch_spec = replace(spec, enrollment_token=token)
        if not provider.background:
            launched = _call(lambda: provider.launch(launch_spec, _ignore))
            # A synchronous provider's facts are kept like a background run's (provisioning).
            cvm.provider_ref, cvm.provider_state = launched.ref, launched.state
            session.add(cvm)
            session.flush()
        else:
            console.leases.take(session, cvm_id)  # this replica's job from the commit on
        return cvm_info(cvm), cvm, token


def _ignore(_event: ProviderEvent) -> None:
    """Synchronous (local) providers report nothing worth keeping."""


def _call[T](action: Callable[[], T]) -> T:
    """Run a synchronous provider call: refusals are Invalid, failures ProviderFailed."""
    try:
        return action()
    except ProviderUnsupported as exc:
        raise Invalid(f"provider: {exc}") from None
    except ProviderError as exc:
        raise ProviderFailed(f"provider: {exc}") from None


def _not_busy(cvm: Cvm) -> None:
    if cvm.state in provisioning.BUSY_STATES:
        raise Conflict(f"CVM {cvm.id} is {cvm.state}; wait for it to finish")


def list_cvms(*, console: Console, user: User, team: str, include_destroyed: bool) -> list[Cvm]:
    """The team's CVMs the caller may see (admin: all; developer: own), oldest first."""
    role = member(user, team)
    query = select(Cvm).where(col(Cvm.team) == team)
    if role != Role.admin:
        query = query.where(col(Cvm.owner) == user.subject)
    if not include_destroyed:
        query = query.where(col(Cvm.state) != CvmState.destroyed)
    with console.write() as session:
        # A CVM that never reached the Console says so here (nothing else would).
        enrollment.mark_never_contacted(session, team)
    with console.session() as session:
        return list(session.execute(query.order_by(col(Cvm.created_at), col(Cvm.id))).scalars())


def get(*, console: Console, user: User, cvm_id: str, team: str | None = None) -> Cvm:
    with console.session() as session:
        return visible_cvm(session, user, cvm_id, team)


def ssh_session(*, console: Console, user: User, cvm_id: str) -> SessionInfo:
    """What `umbra ssh-proxy` needs to attest and reach a Dev CVM (its admins and owner)."""
    with console.session() as db:
        cvm = visible_cvm(db, user, cvm_id)
        if cvm.kind != CvmKind.dev:
            raise Invalid(f"{cvm_id} is not a Dev CVM")
        return session_info(cvm)


def _may_manage(cvm: Cvm, role: Role | None) -> None:
    if role != Role.admin and cvm.kind != CvmKind.dev:
        raise Forbidden("only admins manage Security CVMs")


def update(*, console: Console, user: User, cvm_id: str, change: CvmUpdate) -> CvmInfo:
    """Re-route, change launch inputs (SSH keys, size, a larger data disk) or start/stop: one of
    the last two."""
    try:
        return _update(console=console, user=user, cvm_id=cvm_id, change=change)
    except team_quotas.QuotaRefused as refused:
        team_quotas.audit_refusal(console, user, refused, operation="resize", target=cvm_id)
        raise


def _update(*, console: Console, user: User, cvm_id: str, change: CvmUpdate) -> CvmInfo:
    background: tuple[CvmProvider, Cvm, Operation] | None = None
    update_token: str | None = None
    locks = [cvm_lock(cvm_id)]
    if change.security_cvm_id is not None:
        locks.append(cvm_lock(change.security_cvm_id))
    with console.write(*locks) as session:
        cvm = visible_cvm(session, user, cvm_id)
        role = user.role_in(cvm.team)
        _may_manage(cvm, role)
        if cvm.state == CvmState.destroyed:
            raise Conflict(f"CVM {cvm_id} is destroyed")
        _not_busy(cvm)
        changes: dict[str, object] = {}
        if change.security_cvm_id is not None:
            if role != Role.admin:
                raise Forbidden("only admins re-route Dev CVMs")
            if cvm.kind != CvmKind.dev:
                raise Invalid("security_cvm_id: only Dev CVMs route through one")
            _security_cvm_in_team(session, cvm.team, change.security_cvm_id)
            cvm.security_cvm_id = change.security_cvm_id
            changes["security_cvm_id"] = change.security_cvm_id
        provider = console.providers.get(cvm.provider)
        relaunch = any(v is not None for v in (change.ssh_keys, change.size, change.data_disk_gb))
        asked = CvmState(change.state) if change.state is not None else None
        wants_provider = (asked is not None and asked != cvm.state) or relaunch
        if wants_provider and cvm.provider == security_pool.TEAM_STACK_PROVIDER:
            raise Conflict(f"CVM {cvm_id} is run by its team stack: change it there (`pulumi up`)")
        if wants_provider and provider is None:
            raise Conflict(f"provider {cvm.provider!r} is no longer configured")
        if relaunch:
            assert provider is not None
            if change.state is not None:
                raise Invalid("state: change it in a separate request")
            cvm.ssh_keys = list(change.ssh_keys) if change.ssh_keys is not None else cvm.ssh_keys
            if change.size is not None and cvm.kind == CvmKind.dev:
                team_quotas.check_machine_type(session, cvm.team, change.size)
            cvm.size = change.size if change.size is not None else cvm.size
            if change.data_disk_gb is not None:
                if cvm.kind != CvmKind.dev:
                    raise Invalid("data_disk_gb: only Dev CVMs have a data disk to grow")
                # Resizes and launches of the team count each other (after the CVM lock).
                console.lock(session, policy_lock(cvm.team))
                current = cvm.data_disk_gb or provider.default_data_disk_gb or 0
                team_quotas.check_resize(session, cvm, current, change.data_disk_gb)
                cvm.data_disk_gb = change.data_disk_gb
            spec = provisioning.spec_of(cvm)
            _call(lambda: provider.check(spec))
            changes["launch_inputs"] = {
                "ssh_keys": len(cvm.ssh_keys),
                "size": cvm.size,
                "data_disk_gb": cvm.data_disk_gb,
            }
            if provider.background:
                cvm.state, cvm.state_reason = CvmState.updating, None
                background = (provider, cvm, Operation.update)
                if cvm.kind == CvmKind.dev:
                    # New launch data may replace the VM (Azure custom data): it gets a fresh
                    # one-time token; a VM kept in place holds its credential and ignores it.
                    update_token, _expires = enrollment.issue_token(session, cvm, user.subject)
            else:
                updated = _call(lambda: provider.update(spec, cvm.provider_ref or "", _ignore))
                cvm.provider_ref, cvm.provider_state = updated.ref, updated.state
        if asked is not None and asked != cvm.state:
            assert provider is not None
            if cvm.state == CvmState.failed:
                raise Conflict(f"CVM {cvm_id} failed; update or destroy it")
            running = asked == CvmState.running
            if provider.background:
                # A cloud stop/start takes minutes: the provisioning worker runs it and records
                # `running`/`stopped` (or `failed` with the reason), never this request.
                if not cvm.provider_ref:
                    raise Conflict(
                        f"CVM {cvm_id} has no provider resource to stop or start; update or "
                        "destroy it"
                    )
                cvm.state, cvm.state_reason = CvmState.updating, None
                background = (provider, cvm, Operation.start if running else Operation.stop)
            else:
                _call(lambda: provider.set_running(cvm.provider_ref or "", running))
                cvm.state = asked
            changes["state"] = asked
        if changes:
            _stamp_and_audit(session, user, cvm, AuditAction.cvm_update, changes)
        session.flush()
        if background is not None:
            console.leases.take(session, cvm.id)
        info = cvm_info(cvm)
    if background is not None:
        runner, target, operation = background
        provisioning.submit(console, runner, operation, target, enrollment_token=update_token)
    console.notifier.notify()
    return info


def set_power(*, console: Console, user: User, cvm_id: str, power: Power) -> CvmInfo:
    return update(console=console, user=user, cvm_id=cvm_id, change=CvmUpdate(state=power))


def destroy(*, console: Console, user: User, cvm_id: str) -> CvmInfo:
    """Routing, attachments and the credential end now; a cloud destroy runs after the commit."""
    background: tuple[CvmProvider, Cvm] | None = None
    with console.write(cvm_lock(cvm_id)) as session:
        cvm = visible_cvm(session, user, cvm_id)
        _may_manage(cvm, user.role_in(cvm.team))
        if cvm.state != CvmState.destroyed:
            _not_busy(cvm)
            replicas: list[Cvm] = []
            if cvm.kind == CvmKind.security:
                # Serialized with replica registrations: none joins a pool being destroyed.
                console.lock(session, security_pool.pool_lock(cvm.team))
                replicas = security_pool.live_replicas(session, cvm.id)
            if replicas:
                # Its replicas serve the Dev CVMs routed to it: the pool goes replica by replica.
                raise Conflict(
                    f"CVM {cvm_id} leads a Security CVM pool; destroy its replicas first: "
                    + ", ".join(sorted(r.id for r in replicas))
                )
            provider = console.providers.get(cvm.provider)
            final = CvmState.destroyed
            if provider is not None and provider.background:
                final, background = CvmState.destroying, (provider, cvm)
            elif provider is not None and cvm.provider_ref:
                spec = provisioning.spec_of(cvm)
                _call(lambda: provider.destroy(spec, cvm.provider_ref, _ignore))
            cvm.state = final
            cvm.state_reason = None
            cvm.credential_hash = None
            cvm.profiles = []
            _stamp_and_audit(session, user, cvm, AuditAction.cvm_destroy, {})
        session.flush()
        if background is not None:
            console.leases.take(session, cvm.id)
        info = cvm_info(cvm)
    if background is not None:
        provisioning.submit(console, background[0], Operation.destroy, background[1])
    console.notifier.notify()
    return info


def attach_profiles(
    *,
    console: Console,
    user: User,
    cvm_id: str,
    profiles: list[str],
    if_match: str | None = None,
    team: str | None = None,
) -> CvmInfo:
    """Replace a Dev CVM's attached profiles (admin; the CVM's owner only to add or remove
    agent-login profiles, `umbra connect`); `if_match`: only if they are still this version
    (`profiles_etag`), so a read-modify-write never loses a concurrent change."""
    wanted = sorted(set(profiles))
    with console.write(cvm_lock(cvm_id)) as session:
        cvm = visible_cvm(session, user, cvm_id, team)
        changed = set(wanted) ^ set(cvm.profiles)
        owner_may = bool(changed) and changed <= SELF_SERVICE_PROFILES
        if user.role_in(cvm.team) != Role.admin and not owner_may:
            require_role(user, cvm.team, Role.admin)
        console.lock(session, policy_lock(cvm.team))  # after the CVM lock, as everywhere
        if cvm.kind != CvmKind.dev:
            raise Invalid("profiles: attach profiles to Dev CVMs only")
        if cvm.state == CvmState.destroyed:
            raise Conflict(f"CVM {cvm_id} is destroyed")
        if if_match is not None and if_match.strip('" ') != profiles_etag(cvm.profiles):
            raise Stale(f"CVM {cvm_id}'s attachments changed since you read them; read and retry")
        check_profiles_compose(console, session, cvm.team, wanted)
        cvm.profiles = wanted
        _stamp_and_audit(session, user, cvm, AuditAction.profiles_attach, {"profiles": wanted})
        session.flush()
        info = cvm_info(cvm)
    console.notifier.notify()
    return info


def rotate_credential(*, console: Console, user: User, cvm_id: str) -> CvmCreated:
    """A new credential for a Security CVM, revoking the old one (admin; break-glass: issued
    without attestation, and the audit says so)."""
    # Serialized per CVM: of concurrent rotations, the one that commits last holds the only
    # working credential, and every earlier one is revoked by it.
    with console.write(cvm_lock(cvm_id)) as session:
        cvm = visible_cvm(session, user, cvm_id)
        require_role(user, cvm.team, Role.admin)
        if cvm.kind != CvmKind.security or cvm.state == CvmState.destroyed:
            raise not_found(f"live Security CVM {cvm_id}")
        credential = CREDENTIAL_PREFIX + secrets.token_urlsafe(32)
        cvm.credential_hash = credential_hash(credential)
        _stamp_and_audit(session, user, cvm, AuditAction.cvm_credential, {"break_glass": True})
        session.flush()
        info = cvm_info(cvm)
    return CvmCreated(**info.model_dump(), credential=credential)


def _stamp_and_audit(
    session: Session, user: User, cvm: Cvm, action: AuditAction, details: dict[str, Any]
) -> None:
    """A user's change to a CVM: stamped and audited in the transaction that makes it."""
    cvm.updated_at = utcnow()
    session.add(cvm)
    audit.append(
        session, actor=user.subject, team=cvm.team, action=action, target=cvm.id, details=details
    )
