"""Event logs: digest recomputation, RTMR replay against quotes, CCEL, named-event checks."""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import pytest

from umbra.attest.collateral import Collateral
from umbra.attest.errors import EventLogError
from umbra.attest.eventlog import (
    RUNTIME_EVENT_TYPE,
    dump_ccel,
    dump_dstack_event_log,
    load_event_log,
    parse_ccel,
    parse_dstack_event_log,
    replay,
    runtime_event_digest,
)
from umbra.attest.measurement import MeasurementPolicy, ssh_keys_digest
from umbra.attest.quote import parse_quote
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verdict, verify_quote

from .conftest import T_SIM

KEY_A = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl a@x"
KEY_B = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBbBbBbBbBbBbBbBbBbBbBbBbBbBbBbBbBbBbBbBbBbB b@y"


def _dstack_log(report: dict[str, Any]) -> list[dict[str, Any]]:
    log: list[dict[str, Any]] = json.loads(report["event_log"])
    return log


def test_dstack_log_replays_to_quoted_rtmrs(dstack_report: dict[str, Any]) -> None:
    events = parse_dstack_event_log(report_text := dstack_report["event_log"])
    assert events
    quote = parse_quote(bytes.fromhex(dstack_report["quote"]))
    assert replay(events) == quote.td_report.rtmrs
    runtime = [e for e in events if e.event_type == RUNTIME_EVENT_TYPE]
    assert all(e.recomputed for e in runtime)
    names = [e.name for e in runtime]
    assert "compose-hash" in names
    assert load_event_log(report_text.encode()) == events


def test_runtime_digest_is_recomputed_not_trusted(dstack_report: dict[str, Any]) -> None:
    log = _dstack_log(dstack_report)
    idx = next(i for i, e in enumerate(log) if e["event"] == "compose-hash")
    # A log that omits the digest still replays (the digest comes from name and payload) ...
    no_digest = [dict(e) for e in log]
    no_digest[idx]["digest"] = ""
    quote = parse_quote(bytes.fromhex(dstack_report["quote"]))
    assert replay(parse_dstack_event_log(json.dumps(no_digest))) == quote.td_report.rtmrs
    # ... and a changed payload with the original digest is refused outright.
    tampered = [dict(e) for e in log]
    tampered[idx]["event_payload"] = "00" * 32
    with pytest.raises(EventLogError, match="compose-hash"):
        parse_dstack_event_log(json.dumps(tampered))
    # Changing payload *and* digest consistently makes a log that no longer replays.
    forged = [dict(e) for e in log]
    forged[idx]["event_payload"] = "00" * 32
    forged[idx]["digest"] = runtime_event_digest("compose-hash", bytes(32)).hex()
    assert replay(parse_dstack_event_log(json.dumps(forged)))[3] != quote.td_report.rtmrs[3]


def test_runtime_digest_rule() -> None:
    expected = hashlib.sha384(struct.pack("<I", 0x08000001) + b":app-id:" + b"\x01").digest()
    assert runtime_event_digest("app-id", b"\x01") == expected


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ("{}", "must be a JSON list"),
        ("[1]", "must be an object"),
        ('[{"event_type": 1}]', "missing 'imr'"),
        ('[{"imr": 7, "event_type": 1, "digest": "' + "00" * 48 + '"}]', "not an RTMR"),
        ('[{"imr": 0, "event_type": 6, "digest": "00"}]', "digest is 1 bytes"),
        ('[{"imr": 0, "event_type": 6, "digest": "zz"}]', "hex"),
        ("not json", "not JSON"),
    ],
)
def test_malformed_dstack_logs(doc: str, needle: str) -> None:
    with pytest.raises(EventLogError, match=needle):
        parse_dstack_event_log(doc)


def test_ccel_round_trip_replays_like_dstack(dstack_report: dict[str, Any]) -> None:
    events = parse_dstack_event_log(dstack_report["event_log"])
    blob = dump_ccel(events)
    assert parse_ccel(blob) == events
    assert parse_ccel(blob + b"\xff" * 64) == events  # CCEL tables are padded
    assert load_event_log(blob) == events
    with pytest.raises(EventLogError, match="truncated"):
        parse_ccel(blob[:-5])
    with pytest.raises(EventLogError, match="Spec ID"):
        parse_ccel(struct.pack("<II", 0, 3) + bytes(20) + struct.pack("<I", 4) + b"nope")


def test_dump_and_parse_dstack_are_inverse(tdx: SimulatedTdx) -> None:
    tdx.extend_runtime_event("compose-hash", b"\x07" * 32)
    events = tdx.event_log()
    assert parse_dstack_event_log(dump_dstack_event_log(events)) == events


def _verify(
    pki: SimulatedPki,
    collateral: Collateral,
    tdx: SimulatedTdx,
    binding: dict[str, Any] | None = None,
    **release: Any,
) -> Verdict:
    policy = MeasurementPolicy.model_validate(
        {
            "release": tdx.release_manifest(name="rel", **release).model_dump(),
            "binding": None
            if binding is None
            else {"apiVersion": "umbra/v1", "kind": "InstanceBinding", "release": "rel", **binding},
        }
    )
    return verify_quote(
        tdx.quote(b""),
        policy=policy,
        collateral=collateral,
        now=T_SIM,
        event_log=tdx.event_log(),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )


COMPOSE = hashlib.sha256(b"services: {agent: {image: x}}").digest()
COMPOSE_EVENTS = [{"name": "compose-hash", "payloads": [COMPOSE.hex()]}]


def test_compose_hash_and_ssh_key_events(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx
) -> None:
    tdx.extend_runtime_event("compose-hash", COMPOSE)
    tdx.extend_runtime_event("umbra.ssh-authorized-keys", ssh_keys_digest([KEY_A]))
    v = _verify(pki, sim_collateral, tdx, {"ssh_authorized_keys": [KEY_A]}, events=COMPOSE_EVENTS)
    assert v.ok, v.reasons
    assert v.events_checked == ["compose-hash", "umbra.ssh-authorized-keys"]
    # Another developer's key bound at launch is refused.
    v = _verify(pki, sim_collateral, tdx, {"ssh_authorized_keys": [KEY_B]}, events=COMPOSE_EVENTS)
    assert not v.ok
    assert any("umbra.ssh-authorized-keys" in r for r in v.reasons)


def test_wrong_compose_hash_and_missing_events(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx
) -> None:
    tdx.extend_runtime_event("compose-hash", bytes(32))
    v = _verify(pki, sim_collateral, tdx, {"ssh_authorized_keys": [KEY_A]}, events=COMPOSE_EVENTS)
    assert not v.ok
    text = "\n".join(v.reasons)
    assert "'compose-hash' has payload" in text
    assert "'umbra.ssh-authorized-keys' is missing" in text


def test_duplicate_and_unlisted_events(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx
) -> None:
    tdx.extend_runtime_event("compose-hash", COMPOSE)
    tdx.extend_runtime_event("debug-shell", b"on")
    v = _verify(pki, sim_collateral, tdx, events=COMPOSE_EVENTS)
    assert v.reasons == ["runtime events not in the policy: debug-shell"]
    assert _verify(pki, sim_collateral, tdx, events=COMPOSE_EVENTS, other_runtime_events="allow").ok
    tdx.extend_runtime_event("compose-hash", COMPOSE)
    v = _verify(pki, sim_collateral, tdx, events=COMPOSE_EVENTS, other_runtime_events="allow")
    assert v.reasons == ["event 'compose-hash' appears 2 times in RTMR3"]


def test_log_that_does_not_replay_is_refused(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx
) -> None:
    tdx.extend_runtime_event("compose-hash", COMPOSE)
    raw = tdx.quote(b"")
    log = tdx.event_log()[:-1]  # hide the last event from the verifier
    policy = MeasurementPolicy(release=tdx.release_manifest(events=COMPOSE_EVENTS))
    v = verify_quote(
        raw,
        policy=policy,
        collateral=sim_collateral,
        now=T_SIM,
        event_log=log,
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    assert not v.ok
    assert any(r.startswith("event log replays RTMR3") for r in v.reasons)
    assert v.events_checked == []


def test_expected_events_without_a_log(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx
) -> None:
    policy = MeasurementPolicy(release=tdx.release_manifest(events=COMPOSE_EVENTS))
    v = verify_quote(
        tdx.quote(b""),
        policy=policy,
        collateral=sim_collateral,
        now=T_SIM,
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    assert v.reasons == ["no event log supplied, but the policy expects events: compose-hash"]


def test_unexplained_rtmr3_without_log_is_refused(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx
) -> None:
    tdx.extend_runtime_event("something", b"x")
    raw = tdx.quote(b"")

    def run(other: str) -> Verdict:
        policy = MeasurementPolicy(release=tdx.release_manifest(other_runtime_events=other))
        return verify_quote(
            raw,
            policy=policy,
            collateral=sim_collateral,
            now=T_SIM,
            allow_simulated=True,
            simulated_root_der=pki.root_der,
        )

    assert run("refuse").reasons == [
        "RTMR3 holds runtime events but no event log accounts for them"
    ]
    assert run("allow").ok


def test_named_events_on_the_real_dstack_quote(dstack_report: dict[str, Any]) -> None:
    """The dstack vector has no collateral here, so check events without DCAP."""
    from umbra.attest.verify import event_reasons

    from .conftest import release_for

    raw = bytes.fromhex(dstack_report["quote"])
    events = parse_dstack_event_log(dstack_report["event_log"])
    compose = next(e.payload for e in events if e.name == "compose-hash")
    names = {e.name for e in events if e.event_type == RUNTIME_EVENT_TYPE}

    def check(payload: bytes) -> tuple[list[str], list[str]]:
        release = release_for(
            raw,
            events=[{"name": "compose-hash", "payloads": [payload.hex()]}]
            + [{"name": n} for n in sorted(names - {"compose-hash"})],
        )
        reasons: list[str] = []
        checked = event_reasons(
            parse_quote(raw), MeasurementPolicy(release=release), events, reasons
        )
        return checked, reasons

    checked, reasons = check(compose)
    assert reasons == []
    assert "compose-hash" in checked
    assert set(checked) == names
    checked, reasons = check(bytes(32))
    assert len(reasons) == 1
    assert "'compose-hash' has payload" in reasons[0]
