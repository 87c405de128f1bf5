"""The web view's own read queries (overview chart, profiles, secrets, audit page), scoped by the
caller's role; the traffic and CVM lists are the API's own (`console/services/`).

Authorization is the services' (`require_role`, `visible_cvm`, a developer's traffic is their
own); no page queries the database on its own.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Integer, Table, case, cast, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import col

from umbra.console.audit import ChainReport, save_checkpoint, verify_incremental
from umbra.console.db import as_utc
from umbra.console.enums import AuditAction, CvmKind, CvmState, Role, Scope
from umbra.console.models import (
    AuditEntry,
    Cvm,
    PolicyBundle,
    TrafficRecord,
    TrafficSlot,
    TrafficSlotDenial,
)
from umbra.console.schemas import SecretInfo
from umbra.console.services import cvms, secrets, traffic
from umbra.console.services.access import User, require_role, visible_cvm
from umbra.console.services.policy import current_bundle
from umbra.console.state import Console
from umbra.console.traffic_rollup import DIMENSIONS, SLOT_SECONDS, slot_of
from umbra.contracts.traffic import Decision

TABLE: Table = TrafficRecord.__table__  # type: ignore[attr-defined]
SLOTS: Table = TrafficSlot.__table__  # type: ignore[attr-defined]
DENIALS: Table = TrafficSlotDenial.__table__  # type: ignore[attr-defined]
PAGE_SIZE = 50
LIVE_LIMIT = 100
CHART_BUCKETS = 48
TOP_N = 10


def team_role(user: User, team: str, *allowed: Role) -> Role:
    return require_role(user, team, *(allowed or (Role.admin, Role.developer)))


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
    console: Console,
    user: User,
    team: str,
    seconds: int,
    now: datetime | None = None,
    *,
    rollups: bool = True,
) -> Overview:
    """The chart and top denials over `seconds`. Ranges whose bucket width is whole rollup slots
    (24 h, 7 d, 30 d) read the slots (traffic_rollup.py), their window ending with the current
    slot; shorter ones read the records. `rollups=False` is the records path for any range (the
    benchmark's baseline)."""
    filters = traffic.scoped(user, team, traffic.TrafficFilters())
    now = now or datetime.now(UTC)
    width = max(1, seconds // CHART_BUCKETS)
    if rollups and width % SLOT_SECONDS == 0:
        return _overview_from_slots(console, team, filters.owner, now, width)
    since = now - timedelta(seconds=width * CHART_BUCKETS)
    window = replace(filters, since=since)
    c = TABLE.c
    where = traffic.where(team, window)
    denied = func.sum(case((c.decision == Decision.DENY, 1), else_=0))
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
                        .where(*where, c.decision == Decision.DENY)
                        .group_by(column)
                        .order_by(func.count().desc(), column)
                        .limit(TOP_N)
                    ).all()
                ]
            )
    return _assemble(team, since, width, grouped, tops)


def aligned_window(now: datetime, width: int) -> tuple[int, int]:
    """[start, end) in epoch seconds: 48 buckets of `width` ending with the current slot."""
    end = slot_of(now.timestamp()) + SLOT_SECONDS
    return end - width * CHART_BUCKETS, end


def _overview_from_slots(
    console: Console, team: str, owner: str | None, now: datetime, width: int
) -> Overview:
    start, end = aligned_window(now, width)
    slots, denials = SLOTS.c, DENIALS.c
    where = [slots.team == team, slots.slot >= start, slots.slot < end]
    if owner is not None:
        where.append(slots.owner == owner)
    bucket = ((slots.slot - start) / width).label("bucket")
    with console.session() as session:
        grouped = session.execute(
            select(slots.cvm_id, bucket, func.sum(slots.total), func.sum(slots.denied))
            .where(*where)
            .group_by(slots.cvm_id, bucket)
        ).all()
        tops = []
        for dimension in DIMENSIONS:
            scope = [denials.team == team, denials.dimension == dimension]
            scope += [denials.slot >= start, denials.slot < end]
            if owner is not None:
                scope.append(denials.owner == owner)
            total = func.sum(denials.count)
            tops.append(
                [
                    (str(value) if value else "(none)", int(count))
                    for value, count in session.execute(
                        select(denials.value, total)
                        .where(*scope)
                        .group_by(denials.value)
                        .order_by(total.desc(), denials.value)
                        .limit(TOP_N)
                    ).all()
                ]
            )
    since = datetime.fromtimestamp(start, UTC)
    return _assemble(team, since, width, grouped, tops)


def _assemble(
    team: str, since: datetime, width: int, grouped: Any, tops: list[list[tuple[str, int]]]
) -> Overview:
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
        .where(col(AuditEntry.team) == team, col(AuditEntry.action) == AuditAction.secret_release)
        .group_by(col(AuditEntry.target))
    ).all()
    return {str(target): as_utc(when) for target, when in rows}


def _view(cvm: Cvm, attested: dict[str, datetime]) -> CvmView:
    via = cvm.id if cvm.kind == CvmKind.security else cvm.security_cvm_id
    return CvmView(cvm, attested.get(via) if via else None)


def cvm_list(console: Console, user: User, team: str, include_destroyed: bool) -> list[CvmView]:
    rows = cvms.list_cvms(
        console=console, user=user, team=team, include_destroyed=include_destroyed
    )
    with console.session() as session:
        attested = _attestations(session, team)
    return [_view(row, attested) for row in rows]


def cvm_detail(console: Console, user: User, team: str, cvm_id: str) -> CvmView:
    with console.session() as session:
        cvm = visible_cvm(session, user, cvm_id, team)
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
        query = select(Cvm).where(col(Cvm.team) == team, col(Cvm.state) != CvmState.destroyed)
        if role != Role.admin:
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
    return SecretsView(
        secrets.list_secrets(console=console, user=user, team=team, scope=Scope.team),
        secrets.list_secrets(console=console, user=user, team=team, scope=Scope.personal),
    )


@dataclass(frozen=True)
class AuditView:
    entries: list[AuditEntry]
    older: int | None  # `before` for the next (older) page
    chain: ChainReport


def audit_page(
    console: Console, user: User, team: str, before: int | None, limit: int = PAGE_SIZE
) -> AuditView:
    team_role(user, team, Role.admin)
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
