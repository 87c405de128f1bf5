"""Read-side service layer of the web view: every query a page needs, scoped by the caller's role.

Authorization reuses the API's rules (`require_role`, `visible_cvm`, a developer's traffic is
their own); no page queries the database on its own. Traffic pages use keyset paging on
(time, id) and never count rows, so a page costs the same on the first or the millionth record.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import HTTPException, status
from sqlalchemy import Integer, Table, and_, case, cast, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import col

from umbra.console.audit import ChainReport, save_checkpoint, verify_incremental
from umbra.console.db import as_utc
from umbra.console.deps import Role, User, require_role
from umbra.console.models import AuditEntry, Cvm, PolicyBundle, Secret, TrafficRecord
from umbra.console.routes.common import current_bundle, not_found, visible_cvm
from umbra.console.routes.secrets import secret_info
from umbra.console.routes.traffic import _decode_cursor, _encode_cursor
from umbra.console.schemas import SecretInfo
from umbra.console.state import Console
from umbra.console.web.filters import TrafficFilters

TABLE: Table = TrafficRecord.__table__  # type: ignore[attr-defined]
PAGE_SIZE = 50
LIVE_LIMIT = 100
CHART_BUCKETS = 48
TOP_N = 10


def team_role(user: User, team: str, *allowed: Role) -> Role:
    return require_role(user, team, *(allowed or ("admin", "developer")))


def scoped(user: User, team: str, filters: TrafficFilters) -> TrafficFilters:
    """Apply the API's traffic rule: admins see the team, developers only their own records."""
    role = team_role(user, team)
    if role == "admin":
        return filters
    if filters.owner is not None and filters.owner != user.subject:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "owner: developers see their own traffic")
    return replace(filters, owner=user.subject)


def _where(team: str, filters: TrafficFilters) -> list[ColumnElement[bool]]:
    c = TABLE.c
    clauses: list[ColumnElement[bool]] = [c.team == team]
    for column, value in (
        (c.cvm_id, filters.cvm),
        (c.owner, filters.owner),
        (c.host, filters.host),
        (c.decision, filters.decision),
        (c.reason, filters.reason),
        (c.rule_id, filters.rule),
    ):
        if value is not None:
            clauses.append(column == value)
    if filters.since is not None:
        clauses.append(c.time >= filters.since)
    if filters.until is not None:
        clauses.append(c.time < filters.until)
    return clauses


@dataclass(frozen=True)
class TrafficPageData:
    rows: list[TrafficRecord]
    next_cursor: str | None


def traffic_page(
    console: Console, team: str, filters: TrafficFilters, limit: int = PAGE_SIZE
) -> TrafficPageData:
    c = TABLE.c
    query = select(TrafficRecord).where(*_where(team, filters))
    if filters.cursor is not None:
        when, record_id = _decode_cursor(filters.cursor)
        query = query.where(or_(c.time < when, and_(c.time == when, c.id < record_id)))
    query = query.order_by(c.time.desc(), c.id.desc()).limit(limit + 1)
    with console.session() as session:
        rows = list(session.execute(query).scalars())
    more = len(rows) > limit
    rows = rows[:limit]
    return TrafficPageData(rows, _encode_cursor(rows[-1]) if more and rows else None)


def traffic_newer(
    console: Console, team: str, filters: TrafficFilters, after: str | None
) -> list[TrafficRecord]:
    """Records after the newest one the page shows (oldest first), for the live view."""
    c = TABLE.c
    query = select(TrafficRecord).where(*_where(team, filters))
    if after is not None:
        when, record_id = _decode_cursor(after)
        query = query.where(or_(c.time > when, and_(c.time == when, c.id > record_id)))
        query = query.order_by(c.time.asc(), c.id.asc())
    else:
        query = query.order_by(c.time.desc(), c.id.desc())
    with console.session() as session:
        rows = list(session.execute(query.limit(LIVE_LIMIT)).scalars())
    return rows if after is not None else rows[::-1]


def cursor_of(record: TrafficRecord) -> str:
    return _encode_cursor(record)


def traffic_record(console: Console, user: User, team: str, record_id: str) -> TrafficRecord:
    """One record, visible under the same rule as the traffic list; anything else is a 404."""
    role = team_role(user, team)
    try:
        key = str(uuid.UUID(record_id))
    except ValueError:
        raise not_found("traffic record") from None
    with console.session() as session:
        # Record ids are unique per team: the primary key is (team, id).
        row = session.get(TrafficRecord, (team, key))
    if row is None or row.team != team or (role != "admin" and row.owner != user.subject):
        raise not_found("traffic record")
    return row


# -- overview: chart and top denials ----------------------------------------------------------
@dataclass
class Series:
    label: str
    total: list[int] = field(default_factory=list)
    denied: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Overview:
    since: datetime
    width: int
    team: Series
    cvms: list[Series]
    top_hosts: list[tuple[str, int]]
    top_reasons: list[tuple[str, int]]
    top_rules: list[tuple[str, int]]


def _bucket(session: Session, since: datetime, width: int) -> ColumnElement[Any]:
    start = int(since.timestamp())
    if session.get_bind().dialect.name == "postgresql":
        pg_epoch = func.extract("epoch", TABLE.c.time)
        return cast(func.floor((pg_epoch - start) / width), Integer)
    sqlite_epoch = cast(func.strftime("%s", TABLE.c.time), Integer)
    return (sqlite_epoch - start) / width


def overview(
    console: Console, user: User, team: str, seconds: int, now: datetime | None = None
) -> Overview:
    filters = scoped(user, team, TrafficFilters())
    now = now or datetime.now(UTC)
    width = max(1, seconds // CHART_BUCKETS)
    since = now - timedelta(seconds=width * CHART_BUCKETS)
    window = replace(filters, since=since)
    c = TABLE.c
    where = _where(team, window)
    denied = func.sum(case((c.decision == "deny", 1), else_=0))
    with console.session() as session:
        bucket = _bucket(session, since, width).label("bucket")
        grouped = session.execute(
            select(c.cvm_id, bucket, func.count(), denied).where(*where).group_by(c.cvm_id, bucket)
        ).all()
        tops = []
        for column in (c.host, c.reason, c.rule_id):
            tops.append(
                [
                    (str(value) if value is not None else "(none)", int(count))
                    for value, count in session.execute(
                        select(column, func.count().label("n"))
                        .where(*where, c.decision == "deny")
                        .group_by(column)
                        .order_by(func.count().desc(), column)
                        .limit(TOP_N)
                    ).all()
                ]
            )
    team_series = Series(team, [0] * CHART_BUCKETS, [0] * CHART_BUCKETS)
    per_cvm: dict[str, Series] = {}
    for cvm_id, index, count, deny in grouped:
        if index is None or not 0 <= int(index) < CHART_BUCKETS:
            continue
        label = cvm_id or "(no CVM)"
        series = per_cvm.setdefault(label, Series(label, [0] * CHART_BUCKETS, [0] * CHART_BUCKETS))
        for target in (team_series, series):
            target.total[int(index)] += int(count)
            target.denied[int(index)] += int(deny or 0)
    cvms = sorted(per_cvm.values(), key=lambda s: (-sum(s.total), s.label))
    return Overview(since, width, team_series, cvms, tops[0], tops[1], tops[2])


# -- CVMs, profiles, secrets, audit -----------------------------------------------------------
@dataclass(frozen=True)
class CvmView:
    cvm: Cvm
    attested_at: datetime | None  # the Security CVM's last attested secret release


def _attestations(session: Session, team: str) -> dict[str, datetime]:
    rows = session.execute(
        select(col(AuditEntry.target), func.max(col(AuditEntry.time)))
        .where(col(AuditEntry.team) == team, col(AuditEntry.action) == "secret.release")
        .group_by(col(AuditEntry.target))
    ).all()
    return {str(target): as_utc(when) for target, when in rows}


def _view(cvm: Cvm, attested: dict[str, datetime]) -> CvmView:
    via = cvm.id if cvm.kind == "security" else cvm.security_cvm_id
    return CvmView(cvm, attested.get(via) if via else None)


def cvm_list(console: Console, user: User, team: str, include_destroyed: bool) -> list[CvmView]:
    role = team_role(user, team)
    query = select(Cvm).where(col(Cvm.team) == team)
    if role != "admin":
        query = query.where(col(Cvm.owner) == user.subject)
    if not include_destroyed:
        query = query.where(col(Cvm.state) != "destroyed")
    with console.session() as session:
        rows = list(session.execute(query.order_by(col(Cvm.created_at), col(Cvm.id))).scalars())
        attested = _attestations(session, team)
    return [_view(row, attested) for row in rows]


def cvm_detail(console: Console, user: User, team: str, cvm_id: str) -> CvmView:
    with console.session() as session:
        cvm = visible_cvm(session, user, cvm_id)
        if cvm.team != team:
            raise not_found(f"CVM {cvm_id}")
        return _view(cvm, _attestations(session, team))


@dataclass(frozen=True)
class ProfilesView:
    bundle: PolicyBundle | None
    history: list[PolicyBundle]
    attached: dict[str, list[str]]  # profile -> CVM names that attach it


def profiles(console: Console, user: User, team: str) -> ProfilesView:
    role = team_role(user, team)
    with console.session() as session:
        bundle = current_bundle(session, team)
        history = list(
            session.execute(
                select(PolicyBundle)
                .where(col(PolicyBundle.team) == team)
                .order_by(col(PolicyBundle.serial).desc())
                .limit(10)
            ).scalars()
        )
        query = select(Cvm).where(col(Cvm.team) == team, col(Cvm.state) != "destroyed")
        if role != "admin":
            query = query.where(col(Cvm.owner) == user.subject)
        attached: dict[str, list[str]] = defaultdict(list)
        for cvm in session.execute(query).scalars():
            for name in cvm.profiles:
                attached[name].append(cvm.name)
    return ProfilesView(bundle, history, dict(attached))


def bundle_profiles(console: Console, team: str) -> list[str]:
    with console.session() as session:
        bundle = current_bundle(session, team)
    return list(bundle.profiles) if bundle is not None else []


@dataclass(frozen=True)
class SecretsView:
    team: list[SecretInfo]
    personal: list[SecretInfo]


def secret_list(console: Console, user: User, team: str) -> SecretsView:
    team_role(user, team)
    with console.session() as session:
        base = select(Secret).where(col(Secret.team) == team)
        team_rows = session.execute(
            base.where(col(Secret.scope) == "team").order_by(col(Secret.name))
        ).scalars()
        mine = session.execute(
            base.where(col(Secret.scope) == "personal", col(Secret.owner) == user.subject).order_by(
                col(Secret.name)
            )
        ).scalars()
        return SecretsView([secret_info(r) for r in team_rows], [secret_info(r) for r in mine])


def team_secret_state(console: Console, team: str, name: str) -> tuple[list[str], int] | None:
    """A team secret's hosts and version (metadata only), or None."""
    with console.session() as session:
        row = session.execute(
            select(Secret).where(
                col(Secret.team) == team, col(Secret.scope) == "team", col(Secret.name) == name
            )
        ).scalar_one_or_none()
    return (list(row.hosts), row.version) if row is not None else None


@dataclass(frozen=True)
class AuditView:
    entries: list[AuditEntry]
    older: int | None  # `before` for the next (older) page
    chain: ChainReport


def audit_page(
    console: Console, user: User, team: str, before: int | None, limit: int = PAGE_SIZE
) -> AuditView:
    team_role(user, team, "admin")
    query = select(AuditEntry).where(col(AuditEntry.team) == team)
    if before is not None:
        query = query.where(col(AuditEntry.seq) < before)
    with console.session() as session:
        rows = list(
            session.execute(query.order_by(col(AuditEntry.seq).desc()).limit(limit + 1)).scalars()
        )
        # The chain spans every team. A view verifies the entries after the checkpoint (what
        # earlier views and the last full `audit-verify` covered), then moves it forward.
        chain = verify_incremental(session)
    if chain.ok and chain.entries > chain.from_seq:
        # Best effort: if a concurrent view inserts the row first, the next view moves it.
        with contextlib.suppress(IntegrityError), console.write("audit:checkpoint") as session:
            save_checkpoint(session, chain, full=False)
    more = len(rows) > limit
    rows = rows[:limit]
    return AuditView(rows, rows[-1].seq if more and rows else None, chain)
