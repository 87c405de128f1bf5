"""Tests' RTMR extender for an in-process simulated TEE (production's simulated CVMs log instead:
`launch_agent.LogOnly`)."""

from __future__ import annotations

from dataclasses import dataclass

from umbra.attest.eventlog import Event
from umbra.attest.simulator import SimulatedTdx


@dataclass(frozen=True)
class SimulatedRtmr:
    """Extend the simulator's state (the quote source replays the same log)."""

    tdx: SimulatedTdx

    def extend(self, event: Event) -> None:
        self.tdx.extend_runtime_event(event.name, event.payload, event.imr)
