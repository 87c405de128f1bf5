"""Write-only secrets: set (sealed under the key encryption key, versioned, conditional), list
(metadata only) and delete. Values go in; only metadata ever comes out."""

from __future__ import annotations

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console import audit
from umbra.console.enums import AuditAction, Role, Scope, SecretStatus
from umbra.console.envelope import seal, secret_aad
from umbra.console.models import Secret, utcnow
from umbra.console.schemas import SecretInfo, TeamSecretSet
from umbra.console.services.access import User, member, require_role
from umbra.console.services.errors import Invalid, Stale, Unavailable, not_found
from umbra.console.state import Console
from umbra.contracts.secret_kinds import SecretKind, material_text, parse_material
from umbra.contracts.validation import problems


def secret_lock(team: str, scope: Scope, owner: str, name: str) -> str:
    """Concurrent sets of one secret (even the first) run one after the other: no lost version
    bumps, no unique violation."""
    return f"secret:{team}:{scope}:{owner}:{name}"


def checked_material(kind: SecretKind, value: str) -> str:
    """The text to seal for `kind`; a document that is not one is refused field by field, never
    quoting the input (it holds secrets)."""
    try:
        return material_text(parse_material(kind, value))
    except ValidationError as exc:
        raise Invalid(f"{kind} secret: " + problems(exc)) from None
    except ValueError as exc:
        raise Invalid(str(exc)) from None


def secret_info(row: Secret) -> SecretInfo:
    scope = Scope.personal if row.scope == Scope.personal else Scope.team
    return SecretInfo(
        team=row.team,
        scope=scope,
        owner=row.owner or None,
        name=row.name,
        ref=f"{scope}/{row.name}",
        hosts=list(row.hosts),
        version=row.version,
        kind=row.kind,
        status=row.status,
        updated_by=row.updated_by,
        updated_at=row.updated_at,
    )


def _expected_version(if_match: str | None) -> int | None:
    if if_match is None:
        return None
    tag = if_match.strip().removeprefix("W/").strip('"')
    if not tag.isascii() or not tag.isdigit() or len(tag) > 18:
        raise Invalid('If-Match: expected a secret version such as "3"')
    return int(tag)


def _owner(user: User, team: str, scope: Scope) -> str:
    """Team secrets are the admins'; a personal secret is its caller's (any member)."""
    if scope == Scope.team:
        require_role(user, team, Role.admin)
        return ""
    member(user, team)
    return user.subject


def _row(session: Session, team: str, scope: Scope, owner: str, name: str) -> Secret | None:
    return session.execute(
        select(Secret).where(
            col(Secret.team) == team,
            col(Secret.scope) == scope,
            col(Secret.owner) == owner,
            col(Secret.name) == name,
        )
    ).scalar_one_or_none()


def set_secret(
    *,
    console: Console,
    user: User,
    team: str,
    scope: Scope,
    name: str,
    value: str,
    hosts: list[str],
    if_match: str | None = None,
    kind: SecretKind = SecretKind.static,
) -> SecretInfo:
    """A new version of the secret; `if_match` (a version such as `"3"`): only if it is at that
    version now. A kind other than `static` carries its JSON document in `value`, checked here
    (the Security CVM parses it again) and sealed as its canonical text."""
    owner = _owner(user, team, scope)
    expected_version = _expected_version(if_match)
    if console.keyring is None:
        raise Unavailable("no key encryption key is configured")
    value = checked_material(kind, value)
    hosts = sorted(set(hosts))
    with console.write(secret_lock(team, scope, owner, name)) as session:
        row = _row(session, team, scope, owner, name)
        if expected_version is not None and (row is None or row.version != expected_version):
            # Read under the secret's lock: of concurrent rotations from one version, exactly one
            # commits and the rest are refused.
            now = "does not exist" if row is None else f"is at version {row.version}"
            raise Stale(
                f"secret {scope}/{name} {now}, not version {expected_version}; nothing was changed"
            )
        version = 1 if row is None else row.version + 1
        sealed = seal(
            console.keyring, value.encode(), secret_aad(team, scope, owner, name, version)
        )
        if row is None:
            row = Secret(
                team=team,
                scope=scope,
                owner=owner,
                name=name,
                kek_id="",
                wrapped_key=b"",
                ciphertext=b"",
                updated_by=user.subject,
            )
        row.version = version
        row.hosts = hosts
        row.kind = kind
        # A new value is a new login: whatever refusal marked the old one is history, and a lease
        # on the old chain is void (its commit no longer matches the version).
        row.status = SecretStatus.ok
        row.lease_id = row.lease_holder = row.lease_until = None
        row.kek_id = sealed.kek_id
        row.wrapped_key = sealed.wrapped_key
        row.ciphertext = sealed.ciphertext
        row.updated_by = user.subject
        row.updated_at = utcnow()
        session.add(row)
        audit.append(
            session,
            actor=user.subject,
            team=team,
            action=AuditAction.secret_set,
            target=f"{scope}/{name}",
            details={"owner": owner or None, "hosts": hosts, "version": version, "kind": kind},
        )
        session.flush()
        info = secret_info(row)
    console.notifier.notify()  # Security CVMs long-polling the secrets version wake now
    return info


def list_secrets(*, console: Console, user: User, team: str, scope: Scope) -> list[SecretInfo]:
    """Metadata of the team's secrets (any member), or of the caller's personal ones."""
    member(user, team)
    query = select(Secret).where(col(Secret.team) == team, col(Secret.scope) == scope)
    if scope == Scope.personal:
        query = query.where(col(Secret.owner) == user.subject)
    with console.session() as session:
        rows = session.execute(query.order_by(col(Secret.owner), col(Secret.name))).scalars()
        return [secret_info(row) for row in rows]


def delete_secret(*, console: Console, user: User, team: str, scope: Scope, name: str) -> None:
    owner = _owner(user, team, scope)
    with console.write(secret_lock(team, scope, owner, name)) as session:
        row = _row(session, team, scope, owner, name)
        if row is None:
            raise not_found(f"secret {scope}/{name}")
        session.delete(row)
        audit.append(
            session,
            actor=user.subject,
            team=team,
            action=AuditAction.secret_delete,
            target=f"{scope}/{name}",
            details={"owner": owner or None},
        )
    console.notifier.notify()


def team_secret_state(
    console: Console, team: str, name: str
) -> tuple[list[str], int, SecretKind] | None:
    """A team secret's hosts, version and kind (metadata only), or None."""
    with console.session() as session:
        row = _row(session, team, Scope.team, "", name)
    return (list(row.hosts), row.version, row.kind) if row is not None else None


def rotate_team_secret(
    *, console: Console, user: User, team: str, name: str, value: str
) -> SecretInfo:
    """A new value for an existing team secret, its hosts as they are; conditional on the version
    whose hosts were read, so a concurrent change is refused, never silently overwritten."""
    require_role(user, team, Role.admin)
    state = team_secret_state(console, team, name)
    if state is None:
        raise not_found(f"team secret {name!r}")
    hosts, version, kind = state
    try:
        TeamSecretSet(value=value, hosts=hosts, kind=kind)  # the API's limits, without the API
    except ValidationError as exc:
        # Never echo the input (it is a secret value): field names and messages only.
        raise Invalid(problems(exc)) from None
    return set_secret(
        console=console, user=user, team=team, scope=Scope.team, name=name, value=value,
        hosts=hosts, if_match=f'"{version}"', kind=kind,
    )  # fmt: skip
