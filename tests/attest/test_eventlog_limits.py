"""Event logs: dstack's stripped boot payloads, and the size bounds of the linear parser."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest

from umbra.attest.errors import EventLogError
from umbra.attest.eventlog import (
    EV_EFI_ACTION,
    MAX_EVENTS,
    MAX_LOG_BYTES,
    dump_ccel,
    load_event_log,
    make_event,
    make_runtime_event,
    parse_dstack_event_log,
    replay,
)
from umbra.attest.quote import parse_quote


def _stripped(dstack_report: dict[str, Any], imrs: set[int]) -> str:
    events = json.loads(dstack_report["event_log"])
    for e in events:
        if e["imr"] in imrs:
            e["event_payload"] = ""
    return json.dumps(events)


def test_stripped_boot_payloads_replay_their_logged_digests(dstack_report: dict[str, Any]) -> None:
    """dstack's current format keeps boot-event digests only: RTMR0-2 replay the logged digests
    (pinned by policy), RTMR3 events are still recomputed from their payloads."""
    quoted = parse_quote(bytes.fromhex(dstack_report["quote"])).td_report.rtmrs
    events = parse_dstack_event_log(_stripped(dstack_report, {0, 1, 2}))
    assert replay(events) == quoted
    assert all(e.recomputed for e in events if e.imr == 3)


def test_stripped_runtime_payloads_are_refused(dstack_report: dict[str, Any]) -> None:
    with pytest.raises(EventLogError, match="logged digest does not match"):
        parse_dstack_event_log(_stripped(dstack_report, {3}))


def test_stripped_rtmr3_action_event_is_refused() -> None:
    logged = make_event(1, EV_EFI_ACTION, "", b"real", b"").digest
    # RTMR3 takes runtime events only, stripped or not (test_retyped_events has the attack).
    with pytest.raises(EventLogError, match="RTMR3 accepts only runtime events"):
        make_event(3, EV_EFI_ACTION, "", b"", logged)
    with pytest.raises(EventLogError, match="logged digest does not match"):
        make_event(1, EV_EFI_ACTION, "", b"other", logged)
    assert not make_event(1, EV_EFI_ACTION, "", b"", logged).recomputed


def test_log_size_is_bounded() -> None:
    with pytest.raises(EventLogError, match="larger than"):
        load_event_log(b"[" + b" " * MAX_LOG_BYTES + b"]")
    big = dump_ccel([make_runtime_event(3, "x", b"")]) + b"\x01" * MAX_LOG_BYTES
    with pytest.raises(EventLogError, match="larger than"):
        load_event_log(big)


def test_event_count_is_bounded_including_no_action_records() -> None:
    log = dump_ccel([make_runtime_event(3, "x", b"")])
    no_action = struct.pack("<IIII", 1, 3, 0, 0)  # EV_NO_ACTION, no digests, no data
    with pytest.raises(EventLogError, match=f"more than {MAX_EVENTS} events"):
        load_event_log(log + no_action * (MAX_EVENTS + 1))


def test_digest_count_is_bounded() -> None:
    log = dump_ccel([]) + struct.pack("<III", 4, 0x08000001, 1 << 30)
    with pytest.raises(EventLogError, match="digests, more than"):
        load_event_log(log)


def test_padding_after_the_last_event_ends_the_log() -> None:
    events = [make_runtime_event(3, "a", b"1"), make_runtime_event(3, "b", b"\0\0")]
    raw = dump_ccel(events)
    for pad in (b"", b"\xff" * 300, b"\0" * 300):
        assert [e.name for e in load_event_log(raw + pad)] == ["a", "b"]
