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
from collections.abc import Callable
from typing import Literal

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
from umbra.console.state import Console

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


def submit(console: Console, provider: CvmProvider, operation: Operation, cvm: Cvm) -> None:
    spec, ref = spec_of(cvm), cvm.provider_ref
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
