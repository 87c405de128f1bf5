"""Cloud provider runs outside the request's transaction.

A route records the transitional state (`launching`, `updating` (also for a stop or start),
`destroying`) and its audit
entry in one transaction, commits, and hands the run to `Console.jobs` (a thread pool). The run
reports progress events (each a short transaction keeping the last `MAX_EVENTS` on the row), and
its outcome is recorded in one more transaction: `running`/`destroyed` with the provider's facts,
or `failed` with a one-line reason and nothing of the half-finished run. The outcome is written
only if the row is still in the state the run started from (compare-and-set). At startup
`reconcile` resumes interrupted runs of resumable providers and fails the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Literal

from sqlalchemy import Connection, select, text
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


def _job_key(cvm_id: str) -> int:
    return lock_key(f"job:{cvm_id}")


@contextmanager
def job_guard(console: Console, cvm_id: str, held: Connection | None = None) -> Iterator[None]:
    """Held while a provider run for the CVM is alive in this process: on PostgreSQL a
    session-level advisory lock on its own connection, which the server releases when the process
    dies, so `reconcile` in any worker can tell a live run from an orphaned one. `held`: a
    connection that already holds the lock (a run `reconcile` resumes), released at the end."""
    if console.settings.is_sqlite:
        yield  # one process: everything transitional at startup is orphaned
        return
    connection = held if held is not None else _lock_connection(console)
    try:
        if held is None:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _job_key(cvm_id)})
            connection.commit()
        yield
    finally:
        try:
            connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _job_key(cvm_id)})
            connection.commit()
        finally:
            connection.close()


def _lock_connection(console: Console) -> Connection:
    """Never one of the request pool's: a run holds it for minutes (db.make_lock_engine)."""
    assert console.lock_engine is not None
    return console.lock_engine.connect()


def _claim(console: Console, cvm_id: str) -> Connection | Literal[False] | None:
    """Take the CVM's job lock for `reconcile` without waiting: its connection (PostgreSQL),
    None (SQLite: one process, nothing to take), or False when another worker's run holds it."""
    if console.settings.is_sqlite:
        return None
    connection = _lock_connection(console)
    taken = connection.execute(
        text("SELECT pg_try_advisory_lock(:key)"), {"key": _job_key(cvm_id)}
    ).scalar_one()
    connection.commit()
    if not taken:
        connection.close()
        return False
    return connection


def _release(console: Console, cvm_id: str, held: Connection | None) -> None:
    if held is not None:
        with job_guard(console, cvm_id, held):
            pass


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


def reconcile(console: Console, *, min_age: timedelta | None = None) -> list[str]:
    """At startup: every CVM left transitional by a crash, restart or kill whose run is not alive
    in any Console process is resumed when its provider is `resumable` (the run is submitted again
    for the same operation: Pulumi converges the stack), else marked `failed` with a reason saying
    what was interrupted (the owner or an admin then updates or destroys it; a destroy is
    idempotent). Returns the ids handled.

    Also every `RECONCILE_INTERVAL_SECONDS` while serving (PostgreSQL), with `min_age`: only rows
    unchanged for that long, so a run another replica just committed and is about to claim is
    never taken; a run whose process died (its job lock went with its connection) is taken over
    by a live replica without waiting for a restart."""
    query = select(col(Cvm.id)).where(col(Cvm.state).in_(BUSY_STATES))
    if min_age is not None:
        query = query.where(col(Cvm.updated_at) < utcnow() - min_age)
    with console.session() as session:
        busy = list(session.execute(query).scalars())
    handled, resumed = [], 0
    for cvm_id in busy:
        # The job lock stays held from here into the resumed run: no other worker's reconcile can
        # resume (or fail) the same CVM in between.
        held = _claim(console, cvm_id)
        if held is False:
            continue  # another worker's run is alive
        resume: tuple[CvmProvider, Operation, Cvm] | None = None
        token: str | None = None
        try:
            with console.write(f"cvm:{cvm_id}") as session:
                cvm = session.get(Cvm, cvm_id)
                if cvm is None or cvm.state not in BUSY_STATES:
                    continue
                operation = interrupted_operation(session, cvm)
                provider = console.providers.get(cvm.provider)
                if provider is not None and provider.background and provider.resumable:
                    entry = {
                        "time": utcnow().isoformat(),
                        "kind": "resumed",
                        "message": f"{operation}: resumed after a Console restart",
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
                cvm.updated_at = utcnow()
                session.add(cvm)
                audit.append(
                    session, actor=ACTOR, team=cvm.team, action=action, target=cvm.id,
                    details=details,
                )  # fmt: skip
                if (
                    resume is not None
                    and cvm.kind == CvmKind.dev
                    and operation in (Operation.launch, Operation.update)
                ):
                    # The resumed run renders launch data again: a fresh one-time token, as a
                    # launch or update gets (the interrupted run's may be lost or spent).
                    token, _expires = enrollment.issue_token(session, cvm, ACTOR)
                handled.append(cvm_id)
        finally:
            if resume is None:
                _release(console, cvm_id, held)
        if resume is not None:
            resumed += 1
            submit(console, resume[0], resume[1], resume[2], held=held, enrollment_token=token)
    if handled:
        log.warning(
            "reconciled %d interrupted provider runs: %d resumed, %d failed",
            len(handled), resumed, len(handled) - resumed,
        )  # fmt: skip
    return handled


def submit(
    console: Console,
    provider: CvmProvider,
    operation: Operation,
    cvm: Cvm,
    *,
    held: Connection | None = None,
    enrollment_token: str | None = None,
) -> None:
    spec, ref = replace(spec_of(cvm), enrollment_token=enrollment_token), cvm.provider_ref
    if held is None:
        # Claimed now, not when a worker thread picks the run up: a queued run is alive too, and
        # another replica's periodic `reconcile` must see it so.
        claimed = _claim(console, spec.id)
        if claimed is False:
            log.warning("%s of %s: another Console process runs it", operation, spec.id)
            return
        held = claimed
    try:
        future = console.jobs.submit(run, console, provider, operation, spec, ref, held)
        if held is not None:
            lock = held

            def release_if_cancelled(done: Future[None]) -> None:
                if done.cancelled():  # queued at shutdown: never ran, so never released
                    _release(console, spec.id, lock)

            future.add_done_callback(release_if_cancelled)
    except RuntimeError:  # the pool is shutting down
        _release(console, spec.id, held)
        if provider.resumable:
            return  # left transitional: the next start's `reconcile` resumes it
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
    held: Connection | None = None,
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
        with job_guard(console, spec.id, held):
            reason, result = attempt()
            # Recorded while the job lock is still held: a `reconcile` starting in another
            # worker meanwhile sees a live run, never a finished run still marked transitional.
            if reason is not None and console.stopping.is_set() and provider.resumable:
                # Shutdown ended the provider's children: not the cloud's verdict. Left
                # transitional like after kill -9; the next start resumes the run.
                log.warning(
                    "%s of %s interrupted by shutdown; resumed at start", operation, spec.id
                )
                return
            state = CvmState.failed if reason is not None else SETTLED[operation]
            finish(console, spec, operation, state, reason, result)
    except Exception as exc:  # the job lock itself failed (database unreachable)
        reason = f"{operation}: could not take the job lock ({type(exc).__name__})"
        finish(console, spec, operation, CvmState.failed, reason, None)


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
