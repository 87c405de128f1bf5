"""A TD's firmware event log: the ACPI CCEL table's log area, read once at boot (`--tee tdx`).

TDVF logs every measurement it extends into RTMR0-2 (its own, and the UKI stub's through the
CC measurement protocol) into the log area the CCEL table points at; Linux exposes that area,
LAML bytes padded after the last event, as /sys/firmware/acpi/tables/data/CCEL. The launch
agent writes these events ahead of RTMR3's into the event log the services serve with their
quotes, so a verifier can replay all four RTMRs.

Fail closed: a missing, unreadable, oversized or malformed log, one without a single
measurement, or one with an event on RTMR3 (the agent's register, whose events it logs itself)
is refused, never replaced by an RTMR3-only log (which no verifier would accept anyway, but
only after the CVM had started its services).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from umbra.attest.errors import EventLogError
from umbra.attest.eventlog import (
    MAX_LOG_BYTES,
    RUNTIME_IMR,
    Event,
    dump_dstack_event_log,
    parse_ccel,
)

CCEL_DATA = Path("/sys/firmware/acpi/tables/data/CCEL")
# The served log (dstack JSON: hex payloads) is bounded by MAX_LOG_BYTES at every verifier;
# half of it is left for RTMR3's events, so a log the agent serves is never refused for size.
MAX_FIRMWARE_JSON = MAX_LOG_BYTES // 2


class FirmwareLogError(Exception):
    """The firmware's event log cannot be used (the launch agent refuses to start)."""


@dataclass(frozen=True)
class CcelReader:
    """`Agent.firmware_log` on a TD: RTMR0-2's events from the firmware's CCEL."""

    path: Path = CCEL_DATA

    def __call__(self) -> list[Event]:
        try:
            with self.path.open("rb") as f:
                data = f.read(MAX_LOG_BYTES + 1)  # bounded: never the whole of a huge file
        except OSError as exc:
            raise FirmwareLogError(
                f"{self.path}: {exc.strerror or exc} (no CCEL table: is this a TD whose "
                "firmware logs its measurements?)"
            ) from None
        if len(data) > MAX_LOG_BYTES:
            raise FirmwareLogError(f"{self.path}: larger than {MAX_LOG_BYTES} bytes")
        try:
            events = parse_ccel(data)
        except EventLogError as exc:
            raise FirmwareLogError(f"{self.path}: {exc}") from None
        if not events:
            raise FirmwareLogError(f"{self.path}: no measurement event in the firmware's log")
        if any(e.imr == RUNTIME_IMR for e in events):
            raise FirmwareLogError(
                f"{self.path}: an event on RTMR3 in the firmware's log (RTMR3 is the launch "
                "agent's: it logs that register's events itself)"
            )
        size = len(dump_dstack_event_log(events))
        if size > MAX_FIRMWARE_JSON:
            raise FirmwareLogError(
                f"{self.path}: its events take {size} bytes as the served log, more than "
                f"{MAX_FIRMWARE_JSON}"
            )
        return events
