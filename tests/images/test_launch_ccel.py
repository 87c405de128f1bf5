"""`--tee tdx`: the launch agent reads the firmware's event log from the CCEL table and writes
it ahead of RTMR3's events, so the log the services serve replays all four quoted RTMRs; a
missing or unusable CCEL starts nothing and says why in one serial-console line."""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from umbra.attest.collateral import StaticCollateral
from umbra.attest.eventlog import (
    EV_NO_ACTION,
    MAX_LOG_BYTES,
    TPM_ALG_SHA384,
    Event,
    dump_ccel,
    load_event_log,
    make_runtime_event,
    parse_dstack_event_log,
    replay,
)
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.quote import parse_quote
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verifier
from umbra.images.launch_agent import Agent, LaunchError, Refusal
from umbra.images.launch_ccel import CcelReader, FirmwareLogError

from .simulated_rtmr import SimulatedRtmr
from .test_launch_agent import ALICE, RecordingStarter, _dev_launch, pki

DSTACK = Path(__file__).resolve().parent.parent / "data" / "tdx" / "dstack_quote_report.json"
LAML = 64 * 1024  # TDVF's log area (PcdTcgLogAreaMinLen), all 0xFF before the first event
HEADER = dump_ccel([])  # the Spec ID event alone


def no_action_record(index: int, data: bytes = b"StartupLocality\0\x03") -> bytes:
    """An EV_NO_ACTION record as TCG2 logs write them: one all-zero SHA-384 digest."""
    head = struct.pack("<IIIH", index, EV_NO_ACTION, 1, TPM_ALG_SHA384) + bytes(48)
    return head + struct.pack("<I", len(data)) + data


def tdvf_ccel(events: list[Event], pad: bytes = b"\xff", laml: int = LAML) -> bytes:
    """The log area as a TD's /sys/firmware/acpi/tables/data/CCEL holds it: the Spec ID event,
    the records (an EV_NO_ACTION among them, mid-log), then padding up to LAML."""
    half = len(events) // 2
    blob = dump_ccel(events[:half]) + no_action_record(2) + dump_ccel(events[half:])[len(HEADER) :]
    assert len(blob) <= laml
    return blob + pad * (laml - len(blob))


def test_a_real_tds_firmware_events_read_from_a_ccel_replay_its_quoted_rtmr0_2(
    tmp_path: Path,
) -> None:
    """A real dstack TD's RTMR0-2 events (with their payloads), encoded as its firmware's CCEL,
    read by the agent's reader: they replay to the real quote's RTMR0-2, and with the TD's
    RTMR3 events after them (what the agent writes) to all four."""
    report = json.loads(DSTACK.read_text())
    logged = parse_dstack_event_log(report["event_log"])
    firmware = [e for e in logged if e.imr < 3]
    runtime = [e for e in logged if e.imr == 3]
    quoted = parse_quote(bytes.fromhex(report["quote"])).td_report.rtmrs
    path = tmp_path / "CCEL"
    path.write_bytes(tdvf_ccel(firmware))
    read = CcelReader(path)()
    assert read == firmware
    assert replay(read)[:3] == quoted[:3]
    assert replay([*read, *runtime]) == quoted
    # Zero padding is read the same; without the firmware's events RTMR0 cannot replay.
    path.write_bytes(tdvf_ccel(firmware, pad=b"\0"))
    assert CcelReader(path)() == firmware
    assert replay(runtime)[0] != quoted[0]


@dataclass
class Metadata:
    attributes: dict[str, str]

    def fetch(self) -> dict[str, str]:
        # As GcpMetadata reads them: the instance's umbra-* attributes only.
        return {k: v for k, v in self.attributes.items() if k.startswith("umbra-")}

    def instance_name(self) -> str:
        return "umbra-acme-dev"


__all__ = ["pki"]  # the module PKI fixture, shared with test_launch_agent


def _agent(
    tdx: SimulatedTdx, tmp_path: Path, lines: list[str], ccel: Path | None
) -> tuple[Agent, RecordingStarter]:
    data, _ = _dev_launch()
    starter = RecordingStarter()
    agent = Agent(
        source=Metadata(data.gcp_metadata()),
        extender=SimulatedRtmr(tdx),  # stands in for SysfsRtmr: the TD's RTMR3
        starter=starter,
        reporter=None,
        launch_dir=tmp_path / "launch",
        say=lines.append,
        firmware_log=None if ccel is None else CcelReader(ccel),
    )
    return agent, starter


def test_the_agent_on_a_td_serves_a_log_the_verifier_accepts(
    pki: SimulatedPki, tmp_path: Path
) -> None:
    """A simulated TD whose firmware logged its RTMR0-2 events into the CCEL: the agent's log
    replays every quoted RTMR and the verifier accepts it; the RTMR3-only log the agent wrote
    before (no CCEL reader) is refused for RTMR0."""
    _, m = _dev_launch()
    policy = MeasurementPolicy(release=m.release, binding=m.binding("dev-alice-1", [ALICE]))
    verifier = Verifier(
        policy,
        StaticCollateral(pki.collateral(int(time.time()) - 60)),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    for with_ccel in (True, False):
        tdx = SimulatedTdx(pki, image="umbra-dev-cvm")
        ccel = tmp_path / f"CCEL-{with_ccel}"
        ccel.write_bytes(tdvf_ccel(tdx.event_log()))
        lines: list[str] = []
        launch = tmp_path / f"run-{with_ccel}"
        agent, starter = _agent(tdx, launch, lines, ccel if with_ccel else None)
        agent.run()
        served = load_event_log((launch / "launch/event-log.json").read_bytes())
        verdict = verifier.verify(tdx.quote(b"nonce"), event_log=served)
        if with_ccel:
            assert replay(served) == tdx.rtmrs()
            assert verdict.ok, verdict.reasons
            assert len(starter.started) == 1
        else:
            assert not verdict.ok
            assert any("event log replays RTMR0" in r for r in verdict.reasons)


def _garbled(blob: bytes) -> bytes:
    return blob.replace(b"Spec ID Event03", b"Spec ID Event02", 1)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (None, "No such file"),
        (lambda fw: tdvf_ccel(fw)[: len(HEADER) + 30], "truncated"),
        (lambda fw: _garbled(tdvf_ccel(fw)), "Spec ID"),
        (lambda fw: tdvf_ccel(fw)[:-8] + b"junk\0\0\0\0", "data after the padding"),
        (lambda fw: tdvf_ccel(fw, laml=MAX_LOG_BYTES + 1), f"larger than {MAX_LOG_BYTES}"),
        (lambda fw: tdvf_ccel([]), "no measurement event"),
        (lambda fw: tdvf_ccel([*fw, make_runtime_event(3, "x", b"")]), "event on RTMR3"),
    ],
    ids=["missing", "truncated", "garbled", "junk-after-padding", "oversized", "empty", "rtmr3"],
)
def test_an_unusable_ccel_extends_and_starts_nothing_and_says_why_once(
    pki: SimulatedPki, tmp_path: Path, make: Any, says: str
) -> None:
    tdx = SimulatedTdx(pki, image="umbra-dev-cvm")
    firmware = tdx.event_log()
    ccel = tmp_path / "CCEL"
    if make is not None:
        ccel.write_bytes(make(firmware))
    lines: list[str] = []
    agent, starter = _agent(tdx, tmp_path, lines, ccel)
    with pytest.raises(LaunchError) as caught:
        agent.run()
    assert caught.value.reason is Refusal.FIRMWARE_LOG
    assert len(lines) == 1, lines
    assert lines[0].startswith("umbra-launch: REFUSED, nothing started: firmware_log_unusable")
    assert says in lines[0] and str(ccel) in lines[0]
    assert starter.started == [] and not (tmp_path / "launch").exists()
    assert tdx.event_log() == firmware  # nothing measured into RTMR3 either
    with pytest.raises(FirmwareLogError, match=says):
        CcelReader(ccel)()
