"""Team quotas: how many Dev CVMs each developer may have, how large each Dev CVM's data disk may
be and how much disk a developer and the whole team may hold, and the machine types (a catalog
the admin sets) Dev CVMs may use. Checked in the launch's and the resize's own transaction under
the team's policy lock, so parallel launches and resizes count each other (one defined outcome:
exactly what fits succeeds). A refusal over a quota is a 409 naming the quota, what is used, what
was asked and the limit, and is audited (`cvm.quota_refused`) in a transaction of its own."""

from __future__ import annotations

from typing import Literal

from sqlalchemy import ColumnElement, and_, func, select
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console import audit
from umbra.console.enums import AuditAction, CvmKind, CvmState, Role
from umbra.console.models import Cvm, TeamSettings, utcnow
from umbra.console.schemas import QuotaUsage, TeamQuotas, TeamQuotasInfo
from umbra.console.services.access import User, policy_lock, require_role
from umbra.console.services.errors import Conflict, Invalid
from umbra.console.state import Console

Quota = Literal["max_dev_cvms_per_owner", "max_data_disk_gb_per_owner", "max_data_disk_gb_total"]
_LIMITS = (
    "max_dev_cvms_per_owner",
    "machine_types",
    "min_data_disk_gb",
    "max_data_disk_gb",
    "max_data_disk_gb_per_owner",
    "max_data_disk_gb_total",
)


class QuotaRefused(Conflict):
    """A launch or resize over one of the team's quotas (409); the fields are audited."""

    def __init__(
        self, detail: str, *, quota: Quota, team: str, owner: str, used: int, asked: int,
        limit: int,
    ) -> None:  # fmt: skip
        super().__init__(detail)
        self.quota, self.team, self.owner = quota, team, owner
        self.used, self.asked, self.limit = used, asked, limit


def _live_dev(team: str) -> ColumnElement[bool]:
    return and_(
        col(Cvm.team) == team,
        col(Cvm.kind) == CvmKind.dev,
        col(Cvm.state) != CvmState.destroyed,
    )


def _usage(session: Session, team: str, owner: str) -> QuotaUsage:
    # Data disks recorded before revision 0016_disk_quotas (NULL) count 0 GB.
    disk = func.coalesce(func.sum(col(Cvm.data_disk_gb)), 0)
    total = session.execute(select(disk).where(_live_dev(team))).scalar_one()
    count, mine = session.execute(
        select(func.count(), disk).where(_live_dev(team), col(Cvm.owner) == owner)
    ).one()
    return QuotaUsage(
        owner=owner, dev_cvms=count, data_disk_gb=int(mine or 0), team_data_disk_gb=int(total or 0)
    )


def _info(team: str, row: TeamSettings | None, usage: QuotaUsage | None = None) -> TeamQuotasInfo:
    if row is None:
        return TeamQuotasInfo(team=team, usage=usage)
    return TeamQuotasInfo(
        team=team,
        max_dev_cvms_per_owner=row.max_dev_cvms_per_owner,
        machine_types=sorted(row.machine_types),
        min_data_disk_gb=row.min_data_disk_gb,
        max_data_disk_gb=row.max_data_disk_gb,
        max_data_disk_gb_per_owner=row.max_data_disk_gb_per_owner,
        max_data_disk_gb_total=row.max_data_disk_gb_total,
        updated_by=row.updated_by,
        updated_at=row.updated_at,
        usage=usage,
    )


def get(*, console: Console, user: User, team: str) -> TeamQuotasInfo:
    """The limits and the caller's use of them (developers see their limits, admins too)."""
    require_role(user, team, Role.admin, Role.developer)
    with console.session() as session:
        return _info(team, session.get(TeamSettings, team), _usage(session, team, user.subject))


def put(*, console: Console, user: User, team: str, quotas: TeamQuotas) -> TeamQuotasInfo:
    """Set the limits (audited). CVMs over a lowered limit keep running; new launches wait."""
    require_role(user, team, Role.admin)
    with console.write(policy_lock(team)) as session:
        row = session.get(TeamSettings, team)
        if row is None:
            row = TeamSettings(team=team, updated_by=user.subject)
        previous = _info(team, row).model_dump(include=set(_LIMITS))
        row.max_dev_cvms_per_owner = quotas.max_dev_cvms_per_owner
        row.machine_types = sorted(set(quotas.machine_types))
        row.min_data_disk_gb = quotas.min_data_disk_gb
        row.max_data_disk_gb = quotas.max_data_disk_gb
        row.max_data_disk_gb_per_owner = quotas.max_data_disk_gb_per_owner
        row.max_data_disk_gb_total = quotas.max_data_disk_gb_total
        row.updated_by, row.updated_at = user.subject, utcnow()
        session.add(row)
        now = _info(team, row).model_dump(include=set(_LIMITS))
        audit.append(
            session, actor=user.subject, team=team, action=AuditAction.team_quotas, target=team,
            details={**now, "previous": previous},
        )  # fmt: skip
        session.flush()
        return _info(team, row, _usage(session, team, user.subject))


def check_machine_type(session: Session, team: str, size: str | None) -> None:
    row = session.get(TeamSettings, team)
    if row is None or not row.machine_types or size is None:
        return
    if size not in row.machine_types:
        raise Invalid(
            f"size: {size!r} is not in the team's machine types ({', '.join(row.machine_types)})"
        )


def _check_disk_bounds(row: TeamSettings | None, gb: int | None, *, default: bool) -> None:
    """Each Dev CVM's data disk within the team's [min, max] (a 422 naming `data_disk_gb`)."""
    if row is None or gb is None:
        return
    low, high = row.min_data_disk_gb, row.max_data_disk_gb
    what = f"the provider's default {gb} GB" if default else f"{gb} GB"
    span = f"{low if low is not None else 1}-{high if high is not None else 65536} GB"
    if low is not None and gb < low:
        raise Invalid(
            f"data_disk_gb: {what} is below the team's minimum of {low} GB per Dev CVM "
            f"(allowed: {span})"
        )
    if high is not None and gb > high:
        raise Invalid(
            f"data_disk_gb: {what} is above the team's maximum of {high} GB per Dev CVM "
            f"(allowed: {span})"
        )


def _check_disk_sums(row: TeamSettings, usage: QuotaUsage, team: str, *, asked: int) -> None:
    """`asked` more GB for `usage.owner` fit the developer's and the team's disk quotas."""
    owner = usage.owner
    limits: tuple[tuple[Quota, int | None, int, str], ...] = (
        ("max_data_disk_gb_per_owner", row.max_data_disk_gb_per_owner,
         usage.data_disk_gb, f"{owner}'s Dev CVMs"),
        ("max_data_disk_gb_total", row.max_data_disk_gb_total,
         usage.team_data_disk_gb, f"team {team}'s Dev CVMs"),
    )  # fmt: skip
    for quota, limit, used, whose in limits:
        if limit is not None and used + asked > limit:
            raise QuotaRefused(
                f"quota: {quota}: {whose} use {used} GB of {limit} GB of data disk; this asks "
                f"for {asked} GB more (free {max(limit - used, 0)} GB, or ask an admin to raise it)",
                quota=quota, team=team, owner=owner, used=used, asked=asked, limit=limit,
            )  # fmt: skip


def check_launch(
    session: Session,
    team: str,
    owner: str,
    size: str | None,
    data_disk_gb: int | None = None,
    *,
    default_disk: bool = False,
) -> None:
    """Call inside the Dev CVM launch's transaction, holding the team's policy lock.
    `data_disk_gb`: the size the CVM will be recorded with (`default_disk`: the provider's)."""
    check_machine_type(session, team, size)
    row = session.get(TeamSettings, team)
    if row is None:
        return
    _check_disk_bounds(row, data_disk_gb, default=default_disk)
    usage = _usage(session, team, owner)
    limit = row.max_dev_cvms_per_owner
    if limit is not None and usage.dev_cvms >= limit:
        raise QuotaRefused(
            f"quota: max_dev_cvms_per_owner: {owner} has {usage.dev_cvms} of {limit} Dev CVMs; "
            "destroy one first",
            quota="max_dev_cvms_per_owner", team=team, owner=owner, used=usage.dev_cvms, asked=1,
            limit=limit,
        )  # fmt: skip
    _check_disk_sums(row, usage, team, asked=data_disk_gb or 0)


def check_resize(session: Session, cvm: Cvm, current_gb: int, new_gb: int) -> None:
    """A Dev CVM's data disk grows to `new_gb` (inside the update's transaction, holding the
    team's policy lock): never shrinks, stays within the bounds, fits the disk quotas."""
    if new_gb < current_gb:
        raise Invalid(
            f"data_disk_gb: a data disk only grows ({cvm.id} has {current_gb} GB, asked {new_gb})"
        )
    row = session.get(TeamSettings, cvm.team)
    if row is None or new_gb == current_gb:
        return
    _check_disk_bounds(row, new_gb, default=False)
    usage = _usage(session, cvm.team, cvm.owner)
    recorded = cvm.data_disk_gb or 0  # what `usage` counts for this CVM now
    _check_disk_sums(row, usage, cvm.team, asked=new_gb - recorded)


def audit_refusal(
    console: Console,
    user: User,
    refused: QuotaRefused,
    *,
    operation: Literal["launch", "resize"],
    target: str,
) -> None:
    """The refused request's transaction rolled back: its audit entry commits on its own."""
    with console.write() as session:
        audit.append(
            session, actor=user.subject, team=refused.team, action=AuditAction.cvm_quota_refused,
            target=target,
            details={"operation": operation, "quota": refused.quota, "owner": refused.owner,
                     "used": refused.used, "asked": refused.asked, "limit": refused.limit},
        )  # fmt: skip
