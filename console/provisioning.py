"""Cloud provider runs outside the request's transaction.

A route records the transitional state (`launching`, `updating`, `destroying`) and its audit
entry in one transaction, commits, and hands the run to `Console.jobs` (a thread pool). The run
reports progress events (each a short transaction keeping the last `MAX_EVENTS` on the row), and
its outcome is recorded in one more transaction: `running`/`destroyed` with the provider's facts,
or `failed` with a one-line reason and nothing of the half-finished run. The outcome is written
only if the row is still in the state the run started from (compare-and-set).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Literal

from sqlalchemy import select, text
from sqlmodel import col

from umbra.console import audit
from umbra.console.models import Cvm, utcnow
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
Operation = Literal["launch", "update", "destroy"]
TRANSITIONAL = {"launch": "launching", "update": "updating", "destroy": "destroying"}
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
def job_guard(console: Console, cvm_id: str) -> Iterator[None]:
    """Held while a provider run for the CVM is alive in this process: on PostgreSQL a
    session-level advisory lock on its own connection, which the server releases when the process
    dies, so `reconcile` in any worker can tell a live run from an orphaned one."""
    if console.settings.is_sqlite:
        yield  # one process: everything transitional at startup is orphaned
        return
    with console.engine.connect() as connection:
        connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _job_key(cvm_id)})
        connection.commit()
        try:
            yield
        finally:
            connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _job_key(cvm_id)})
            connection.commit()


def reconcile(console: Console) -> list[str]:
    """At startup: every CVM left transitional by a crash, restart or kill whose run is not alive
    in any Console process is marked `failed` with a reason saying what was interrupted (the
    owner or an admin then updates or destroys it; a destroy is idempotent). Returns their ids."""
    with console.session() as session:
        busy = list(
            session.execute(select(col(Cvm.id)).where(col(Cvm.state).in_(BUSY_STATES))).scalars()
        )
    failed = []
    for cvm_id in busy:
        with console.write(f"cvm:{cvm_id}") as session:
            if not console.settings.is_sqlite:
                free = session.execute(
                    text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": _job_key(cvm_id)}
                ).scalar_one()
                if not free:
                    continue  # another worker's run is alive
            cvm = session.get(Cvm, cvm_id)
            if cvm is None or cvm.state not in BUSY_STATES:
                continue
            operation = next(op for op, state in TRANSITIONAL.items() if state == cvm.state)
            reason = (
                f"{operation}: interrupted by a Console restart; update or destroy the CVM "
                "(the provider may have left resources behind)"
            )
            cvm.state, cvm.state_reason, cvm.updated_at = "failed", reason, utcnow()
            session.add(cvm)
            audit.append(
                session,
                actor=ACTOR,
                team=cvm.team,
                action="cvm.provisioned",
                target=cvm.id,
                details={"operation": operation, "state": "failed", "reason": reason},
            )
            failed.append(cvm_id)
    if failed:
        log.warning("reconciled %d interrupted provider runs as failed", len(failed))
    return failed


def submit(
    console: Console,
    provider: CvmProvider,
    operation: Operation,
    cvm: Cvm,
    *,
    enrollment_token: str | None = None,
) -> None:
    spec, ref = replace(spec_of(cvm), enrollment_token=enrollment_token), cvm.provider_ref
    try:
        console.jobs.submit(run, console, provider, operation, spec, ref)
    except RuntimeError:  # the pool is shutting down: do not leave the row transitional
        finish(
            console, spec, operation, "failed", f"{operation}: the Console is shutting down", None
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
        "launch": lambda emit: provider.launch(spec, emit),
        "update": lambda emit: provider.update(spec, ref or "", emit),
        "destroy": lambda emit: provider.destroy(spec, ref, emit),
    }
    result: Provisioned | None = None
    reason: str | None = None
    try:
        with job_guard(console, spec.id):
            result = calls[operation](on_event)
    except ProviderError as exc:
        reason = one_line(f"{operation}: {exc}", 512)
    except Exception as exc:
        log.error(
            "provider %s %s of %s raised %s", provider.name, operation, spec.id, type(exc).__name__
        )
        reason = f"{operation}: the provider failed unexpectedly ({type(exc).__name__})"
    done = "destroyed" if operation == "destroy" else "running"
    state = "failed" if reason is not None else done
    finish(console, spec, operation, state, reason, result)


def finish(
    console: Console,
    spec: CvmSpec,
    operation: Operation,
    state: str,
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
                action="cvm.provisioned",
                target=cvm.id,
                details=details,
            )
    except Exception as exc:
        log.error(
            "could not record the %s outcome of %s (%s)", operation, spec.id, type(exc).__name__
        )
        return
    console.notifier.notify()
