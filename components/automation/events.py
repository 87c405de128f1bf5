"""Engine events turned into small `ProvisionEvent`s for the Console's progress callback."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pulumi import automation as auto


class EventKind(StrEnum):
    STARTED = "started"
    RESOURCE = "resource"
    DIAGNOSTIC = "diagnostic"
    POLICY = "policy"
    SUMMARY = "summary"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True)
class ProvisionEvent:
    kind: EventKind
    message: str
    urn: str | None = None
    op: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)


OnProvisionEvent = Callable[[ProvisionEvent], None]


def translate_event(event: auto.EngineEvent) -> ProvisionEvent | None:
    """Engine events the Console shows; the rest (stdout echo, prelude) are dropped."""
    if event.resource_pre_event is not None:
        md = event.resource_pre_event.metadata
        return ProvisionEvent(
            EventKind.RESOURCE, f"{md.op.value} {md.type}", urn=md.urn, op=md.op.value
        )
    if event.res_outputs_event is not None:
        md = event.res_outputs_event.metadata
        return ProvisionEvent(
            EventKind.RESOURCE, f"done {md.op.value} {md.type}", urn=md.urn, op=md.op.value
        )
    if event.res_op_failed_event is not None:
        md = event.res_op_failed_event.metadata
        return ProvisionEvent(
            EventKind.FAILED, f"failed {md.op.value} {md.type}", urn=md.urn, op=md.op.value
        )
    if event.diagnostic_event is not None and event.diagnostic_event.severity in (
        "warning",
        "error",
    ):
        d = event.diagnostic_event
        return ProvisionEvent(
            EventKind.DIAGNOSTIC, d.message.strip(), urn=d.urn, data={"severity": d.severity}
        )
    if event.policy_event is not None:
        p = event.policy_event
        return ProvisionEvent(
            EventKind.POLICY,
            f"{p.policy_name}: {p.message.strip()}",
            urn=p.resource_urn,
            data={"enforcement": p.enforcement_level},
        )
    if event.summary_event is not None:
        changes = {
            str(k.value if hasattr(k, "value") else k): v
            for k, v in event.summary_event.resource_changes.items()
        }
        return ProvisionEvent(EventKind.SUMMARY, f"changes: {changes}", data={"changes": changes})
    return None


def relay(on_event: OnProvisionEvent) -> Callable[[auto.EngineEvent], None]:
    """An engine `on_event` that passes on what `translate_event` keeps."""

    def forward(event: auto.EngineEvent) -> None:
        mapped = translate_event(event)
        if mapped is not None:
            on_event(mapped)

    return forward
