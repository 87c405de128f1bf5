"""The launch a CVM's event log shows: its launch-bound runtime events (re-enrollment's key).

Reads attest's event types, so it lives here rather than in `contracts` (a leaf); the event names
and the binding's digest are the wire contract (`contracts/enrollment.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from umbra.attest.eventlog import RUNTIME_EVENT_TYPE, Event
from umbra.contracts.enrollment import LAUNCH_BOUND_EVENTS

_RTMR3 = 3


class LaunchBindingError(ValueError):
    """The event log does not show one launch: an event twice, or no CVM id."""


def launch_binding(events: Sequence[Event]) -> dict[str, str]:
    """The launch-bound runtime events of a log (name -> payload hex), each present at most once
    and `umbra.cvm-id` required. Only meaningful for a log that replayed against a verified quote."""
    found: dict[str, str] = {}
    for event in events:
        if event.event_type != RUNTIME_EVENT_TYPE or event.imr != _RTMR3:
            continue
        if event.name in LAUNCH_BOUND_EVENTS:
            if event.name in found:
                raise LaunchBindingError(f"launch event {event.name!r} appears twice")
            found[event.name] = event.payload.hex()
    if "umbra.cvm-id" not in found:
        raise LaunchBindingError("the event log has no umbra.cvm-id event")
    return found
