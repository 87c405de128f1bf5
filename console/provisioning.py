"""Cloud provider runs outside the request's transaction.

A route records the transitional state (`launching`, `updating` (also for a stop or start),
`destroying`) and its audit
entry in one transaction, commits, and hands the run to `Console.jobs` (a thread pool). The run
reports progress events (each a short transaction keeping the last `MAX_EVENTS` on the row), and
its outcome is recorded in one more transaction: `running`/`destroyed` with the provider's facts,
or `failed` with a one-line reason and nothing of the half-finished run. The outcome is written
only if the row is still in the state the run started from and (PostgreSQL) this replica still
holds the job's lease (compare-and-set). `reconcile` takes over runs no live process runs
(SQLite: at startup; PostgreSQL: rows with an expired or missing lease, console/leases.py),
resuming those of resumable providers and failing the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

from sqlalchemy import select, text
from sqlalchemy.orm import Session
from sqlmodel import col

from umbra.console import audit, enrollment
from umbra.console.enums import AuditAction, CvmKind, CvmState, Operation, Power
from umbra.console.models import AuditEntry, Cvm, utcnow
from umbra.console.providers import (
    CvmProvider,
    CvmSpec,
    OnProviderEvent,
    ProviderError,
    ProviderEvent,
    Provisioned,
    one_line,
)
from umbra.console.state import Console, lock_key

log = logging.getLogger("umbra.console.provisioning")
MAX_EVENTS = 50
ACTOR = "umbra-console"
# A cloud stop/start shows as `updating` (the provider is changing the machine) until it settles.
TRANSITIONAL: dict[Operation, CvmState] = {
    Operation.launch: CvmState.launching,
    Operation.update: CvmState.updating,
    Operation.destroy: CvmState.destroying,
    Operation.start: CvmState.updating,
    Operation.stop: CvmState.updating,
}
SETTLED: dict[Operation, CvmState] = {
    Operation.launch: CvmState.running,
    Operation.update: CvmState.running,
    Operation.destroy: CvmState.destroyed,
    Operation.start: CvmState.running,
    Operation.stop: CvmState.stopped,
}
BUSY_STATES = frozenset(TRANSITIONAL.values())


def spec_of(cvm: Cvm) -> CvmSpec:
    return CvmSpec(
        id=cvm.id,
        team=cvm.team,
        name=cvm.name,
        kind=cvm.kind,
        owner=cvm.owner,
        ssh_keys=tuple(cvm.ssh_keys),
        size=cvm.size,
        data_disk_gb=cvm.data_disk_gb,
    )


def record_event(console: Console, cvm_id: str, event: ProviderEvent) -> None:
    entry = {
        "time": utcnow().isoformat(),
        "kind": one_line(event.kind, 32),
        "message": one_line(event.message),
    }
    try:
        with console.write(f"cvm:{cvm_id}") as session:
            cvm = session.get(Cvm, cvm_id)
            if cvm is not None:
                cvm.events = [*cvm.events, entry][-MAX_EVENTS:]
                session.add(cvm)
    except Exception as exc:  # progress is best effort; the outcome is what must land
        log.warning("could not record a provider event for %s (%s)", cvm_id, type(exc).__name__)


def interrupted_operation(session: Session, cvm: Cvm) -> Operation:
    """What the interrupted run was doing. `updating` covers an update and a stop/start: the
    `cvm.update` audit entry that put the row there (same transaction) says which."""
    if cvm.state != CvmState.updating:
        return Operation.launch if cvm.state == CvmState.launching else Operation.destroy
    details = session.execute(
        select(col(AuditEntry.details))
        .where(col(AuditEntry.target) == cvm.id, col(AuditEntry.action) == AuditAction.cvm_update)
        .order_by(col(AuditEntry.seq).desc())
        .limit(1)
    ).scalar_one_or_none()
    asked = (details or {}).get("state")
    if asked == Power.running:
        return Operation.start
    return Operation.stop if asked == Power.stopped else Operation.update


def reconcile(console: Console, *, limit: int = 100) -> list[str]:
    """Take over provider runs no live Console process runs: each is resumed when its provider is
    `resumable` (the run is submitted again for the same operation: Pulumi converges the stack),
    else marked `failed` with a reason saying what was interrupted (the owner or an admin then
    updates or destroys it; a destroy is idempotent). Returns the ids handled.

    SQLite (one process): at startup, every transitional row is orphaned. PostgreSQL: at startup
    and every `RECONCILE_INTERVAL_SECONDS`, rows whose job lease is missing or expired (console/
    leases.py) are claimed one at a time with `SELECT … FOR UPDATE SKIP LOCKED` and leased to this
    replica in the same transaction, so concurrent replicas never claim the same job and a job
    whose replica died (kill -9: its heartbeat stopped) is taken over exactly once."""
    handled: list[str] = []
    resumed = 0
    if console.settings.is_sqlite:
        with console.session() as session:
            pending = list(
                session.execute(
                    select(col(Cvm.id)).where(col(Cvm.state).in_(BUSY_STATES))
                ).scalars()
            )
        limit = max(limit, len(pending))  # only at startup: every one of them, now
    skipped = console.leases.held()  # ours, even if a late renewal let them lapse
    for _ in range(limit):
        if console.settings.is_sqlite:
            if not pending:
                break
            target: str | None = pending.pop(0)
        else:
            target = None
        resume: tuple[CvmProvider, Operation, Cvm] | None = None
        token: str | None = None
        with console.write(*([f"cvm:{target}"] if target else [])) as session:
            if target is None:
                query = (
                    select(Cvm)
                    .where(col(Cvm.state).in_(BUSY_STATES), console.leases.claimable())
                    .order_by(col(Cvm.updated_at))
                    .limit(1)
                    .with_for_update(skip_locked=True)
                )
                if skipped:
                    query = query.where(col(Cvm.id).not_in(sorted(skipped)))
                cvm = session.execute(query).scalar_one_or_none()
                if cvm is None:
                    break
                # The CVM's write lock, without waiting (a writer holding it while we hold the
                # row would deadlock): a run recording its outcome right now is left alone.
                if not session.execute(
                    text("SELECT pg_try_advisory_xact_lock(:key)"),
                    {"key": lock_key(f"cvm:{cvm.id}")},
                ).scalar_one():
                    skipped.add(cvm.id)
                    continue
            else:
                cvm = session.get(Cvm, target)
                if cvm is None or cvm.state not in BUSY_STATES:
                    continue
            resume, token = _take_over(console, session, cvm)
            handled.append(cvm.id)
        if resume is not None:
            resumed += 1
            submit(console, resume[0], resume[1], resume[2], enrollment_token=token)
    if handled:
        log.warning(
            "took over %d interrupted provider runs: %d resumed, %d failed",
            len(handled), resumed, len(handled) - resumed,
        )  # fmt: skip
    return handled


def _take_over(
    console: Console, session: Session, cvm: Cvm
) -> tuple[tuple[CvmProvider, Operation, Cvm] | None, str | None]:
    """Resume (lease it to this replica) or fail one orphaned run, audited, in the caller's
    transaction. Returns what to submit after commit and the resumed launch's fresh token."""
    operation = interrupted_operation(session, cvm)
    provider = console.providers.get(cvm.provider)
    resume: tuple[CvmProvider, Operation, Cvm] | None = None
    token: str | None = None
    if provider is not None and provider.background and provider.resumable:
        entry = {
            "time": utcnow().isoformat(),
            "kind": "resumed",
            "message": f"{operation}: resumed after its Console process stopped",
        }
        cvm.events = [*cvm.events, entry][-MAX_EVENTS:]
        details: dict[str, object] = {"operation": operation, "state": cvm.state}
        action = AuditAction.cvm_resumed
        resume = (provider, operation, cvm)
    else:
        reason = (
            f"{operation}: interrupted by a Console restart; update or destroy the "
            "CVM (the provider may have left resources behind)"
        )
        cvm.state, cvm.state_reason = CvmState.failed, reason
        details = {"operation": operation, "state": CvmState.failed, "reason": reason}
        action = AuditAction.cvm_provisioned
        cvm.lease_owner = cvm.lease_until = None
    cvm.updated_at = utcnow()
    session.add(cvm)
    audit.append(session, actor=ACTOR, team=cvm.team, action=action, target=cvm.id, details=details)
    if resume is not None:
        console.leases.take(session, cvm.id)
        if cvm.kind == CvmKind.dev and operation in (Operation.launch, Operation.update):
            # The resumed run renders launch data again: a fresh one-time token, as a
            # launch or update gets (the interrupted run's may be lost or spent).
            token, _expires = enrollment.issue_token(session, cvm, ACTOR)
    return resume, token


def submit(
    console: Console,
    provider: CvmProvider,
    operation: Operation,
    cvm: Cvm,
    *,
    enrollment_token: str | None = None,
) -> None:
    """Queue the run of a job whose lease this replica took in the transaction that committed
    the transitional state (`console.leases.take`)."""
    spec, ref = replace(spec_of(cvm), enrollment_token=enrollment_token), cvm.provider_ref
    console.leases.hold(spec.id)
    try:
        future = console.jobs.submit(run, console, provider, operation, spec, ref)

        def release_if_cancelled(done: Future[None]) -> None:
            if done.cancelled():  # queued at shutdown: never ran; another replica takes it
                console.leases.release(spec.id)

        future.add_done_callback(release_if_cancelled)
    except RuntimeError:  # the pool is shutting down
        console.leases.release(spec.id)
        if provider.resumable:
            return  # left transitional: another replica or the next start resumes it
        finish(
            console,
            spec,
            operation,
            CvmState.failed,
            f"{operation}: the Console is shutting down",
            None,
        )


def run(
    console: Console,
    provider: CvmProvider,
    operation: Operation,
    spec: CvmSpec,
    ref: str | None,
) -> None:
    def on_event(event: ProviderEvent) -> None:
        record_event(console, spec.id, event)

    calls: dict[Operation, Callable[[OnProviderEvent], Provisioned | None]] = {
        Operation.launch: lambda emit: provider.launch(spec, emit),
        Operation.update: lambda emit: provider.update(spec, ref or "", emit),
        Operation.destroy: lambda emit: provider.destroy(spec, ref, emit),
        Operation.start: lambda _emit: provider.set_running(ref or "", True),
        Operation.stop: lambda _emit: provider.set_running(ref or "", False),
    }

    def attempt() -> tuple[str | None, Provisioned | None]:
        try:
            return None, calls[operation](on_event)
        except ProviderError as exc:
            return one_line(f"{operation}: {exc}", 512), None
        except Exception as exc:
            log.error(
                "provider %s %s of %s raised %s",
                provider.name, operation, spec.id, type(exc).__name__,
            )  # fmt: skip
            return f"{operation}: the provider failed unexpectedly ({type(exc).__name__})", None

    try:
        # No database connection is held during the provider call: the lease is renewed by the
        # replica's heartbeat (console/leases.py).
        reason, result = attempt()
        if reason is not None and console.stopping.is_set() and provider.resumable:
            # Shutdown ended the provider's children: not the cloud's verdict. Left transitional
            # like after kill -9, its lease given up: another replica (or the next start)
            # resumes the run.
            log.warning("%s of %s interrupted by shutdown; resumed elsewhere", operation, spec.id)
            console.leases.release(spec.id)
            return
        console.leases.drop(spec.id)  # not renewed past here: `finish` clears the lease
        state = CvmState.failed if reason is not None else SETTLED[operation]
        finish(console, spec, operation, state, reason, result)
    finally:
        console.leases.drop(spec.id)


def finish(
    console: Console,
    spec: CvmSpec,
    operation: Operation,
    state: CvmState,
    reason: str | None,
    result: Provisioned | None,
) -> None:
    try:
        with console.write(f"cvm:{spec.id}") as session:
            cvm = session.get(Cvm, spec.id)
            if cvm is None or cvm.state != TRANSITIONAL[operation]:
                log.warning(
                    "%s of %s finished but the CVM moved on; not recorded", operation, spec.id
                )
                return
            if not console.leases.owns(cvm):
                # Taken over while this replica could not renew its lease: the run that took
                # over records the outcome, never both.
                log.warning(
                    "%s of %s finished after its lease was taken over; not recorded",
                    operation, spec.id,
                )  # fmt: skip
                return
            cvm.lease_owner = cvm.lease_until = None
            cvm.state = state
            cvm.state_reason = reason[:512] if reason else None
            if result is not None:
                cvm.provider_ref = result.ref
                cvm.provider_state = result.state
            cvm.updated_at = utcnow()
            session.add(cvm)
            details: dict[str, object] = {"operation": operation, "state": state}
            if reason:
                details["reason"] = cvm.state_reason
            audit.append(
                session,
                actor=ACTOR,
                team=cvm.team,
                action=AuditAction.cvm_provisioned,
                target=cvm.id,
                details=details,
            )
    except Exception as exc:
        log.error(
            "could not record the %s outcome of %s (%s)", operation, spec.id, type(exc).__name__
        )
        return
    console.notifier.notify()
