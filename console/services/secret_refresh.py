"""Rotated refresh tokens written back by Security CVMs: lease, compare-and-swap commit, refusal.

Every step runs under the secret's own lock (`secret_lock`, a PostgreSQL advisory lock), so of
replicas racing for one chain exactly one holds the lease, a commit lands only with the lease and
version it was granted for, and a user's new login (a new version) voids any lease on the old one.
"""

from __future__ import annotations

import secrets as token_source
from datetime import UTC, datetime, timedelta

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console import audit
from umbra.console.enums import AuditAction, Scope, SecretStatus
from umbra.console.envelope import seal, secret_aad
from umbra.console.models import Cvm, Secret, utcnow
from umbra.console.services.errors import Conflict, Invalid, Stale, Unavailable, not_found
from umbra.console.services.secrets import secret_lock
from umbra.console.services.security_cvm import served_owners
from umbra.console.state import Console
from umbra.contracts.secret_kinds import OAuth2Refresh, SecretKind, material_text, parse_material
from umbra.contracts.secret_refresh import (
    LeaseGrant,
    RefreshCommit,
    RefreshCommitted,
    RefreshFailure,
    SecretAt,
)
from umbra.contracts.validation import problems

LEASE_SECONDS = 30  # longer than a refresh's bounded wait; an expired lease may be taken over


def _scope_name(ref: str) -> tuple[Scope, str]:
    scope, _, name = ref.partition("/")
    return Scope(scope), name


def _served_row(session: Session, caller: Cvm, at: SecretAt) -> Secret:
    """The secret, if a release to `caller` would carry it (else 404, as for one that is absent)."""
    scope, name = _scope_name(at.ref)
    owner = at.owner or ""
    if (scope == Scope.personal) != bool(owner):
        raise Invalid("a personal secret names its owner; a team secret none")
    row = session.execute(
        select(Secret).where(
            col(Secret.team) == caller.team,
            col(Secret.scope) == scope,
            col(Secret.owner) == owner,
            col(Secret.name) == name,
        )
    ).scalar_one_or_none()
    if row is not None and scope == Scope.personal and owner not in served_owners(session, caller):
        row = None
    if row is None:
        raise not_found(f"secret {at.ref}")
    if row.kind != SecretKind.oauth2_refresh:
        raise Invalid(f"secret {at.ref} is {row.kind}: only oauth2-refresh chains are written back")
    return row


def _lock(caller: Cvm, at: SecretAt) -> str:
    scope, name = _scope_name(at.ref)
    return secret_lock(caller.team, scope, at.owner or "", name)


def acquire_lease(console: Console, caller: Cvm, at: SecretAt) -> LeaseGrant:
    now = utcnow()
    with console.write(_lock(caller, at)) as session:
        row = _served_row(session, caller, at)
        if row.version != at.version:
            raise Stale(f"secret {at.ref} is at version {row.version}, not {at.version}")
        if row.status == SecretStatus.needs_login:
            raise Conflict(f"secret {at.ref} needs a new login")
        if (
            row.lease_id is not None
            and row.lease_until is not None
            and _aware(row.lease_until) > now
            and row.lease_holder != caller.id
        ):
            raise Conflict(f"secret {at.ref} is being refreshed by another replica")
        row.lease_id = token_source.token_urlsafe(24)
        row.lease_holder = caller.id
        row.lease_until = now + timedelta(seconds=LEASE_SECONDS)
        session.add(row)
        return LeaseGrant(lease=row.lease_id, until=row.lease_until, version=row.version)


def commit_refresh(console: Console, caller: Cvm, commit: RefreshCommit) -> RefreshCommitted:
    """Store the rotated chain as the next version, only under the lease it was granted."""
    if console.keyring is None:
        raise Unavailable("no key encryption key is configured")
    try:
        document = parse_material(SecretKind.oauth2_refresh, commit.document)
    except ValidationError as exc:
        raise Invalid("oauth2-refresh document: " + problems(exc)) from None
    except ValueError as exc:
        raise Invalid(str(exc)) from None
    assert isinstance(document, OAuth2Refresh)
    with console.write(_lock(caller, commit)) as session:
        row = _served_row(session, caller, commit)
        if row.version != commit.version or row.lease_id != commit.lease:
            raise Stale(f"secret {commit.ref}: the lease or version no longer holds")
        version = row.version + 1
        sealed = seal(
            console.keyring,
            material_text(document).encode(),
            secret_aad(row.team, row.scope, row.owner, row.name, version),
        )
        row.version = version
        row.kek_id, row.wrapped_key, row.ciphertext = (
            sealed.kek_id,
            sealed.wrapped_key,
            sealed.ciphertext,
        )
        row.status = SecretStatus.ok
        row.lease_id = row.lease_holder = row.lease_until = None
        row.updated_by = f"security-cvm:{caller.id}"
        row.updated_at = utcnow()
        session.add(row)
        audit.append(
            session,
            actor=f"security-cvm:{caller.id}",
            team=caller.team,
            action=AuditAction.secret_refresh,
            target=commit.ref,
            details={"owner": commit.owner, "version": version},
        )
    console.notifier.notify()  # every replica re-releases and continues the chain from here
    return RefreshCommitted(version=version)


def report_failure(console: Console, caller: Cvm, failure: RefreshFailure) -> None:
    """Give the lease back; a refusal marks the secret as needing a new login (once)."""
    with console.write(_lock(caller, failure)) as session:
        row = _served_row(session, caller, failure)
        if row.version != failure.version or row.lease_id != failure.lease:
            raise Stale(f"secret {failure.ref}: the lease or version no longer holds")
        row.lease_id = row.lease_holder = row.lease_until = None
        if failure.refused:
            row.status = SecretStatus.needs_login
            audit.append(
                session,
                actor=f"security-cvm:{caller.id}",
                team=caller.team,
                action=AuditAction.secret_refresh_failed,
                target=failure.ref,
                details={"owner": failure.owner, "version": row.version, "detail": failure.detail},
            )
        session.add(row)
    if failure.refused:
        console.notifier.notify()


def _aware(moment: datetime) -> datetime:
    """SQLite hands back naive datetimes; they were stored in UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
