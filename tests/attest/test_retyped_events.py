"""Re-typed runtime events (issue 24): RTMR3 accepts runtime events only.

The attack: whoever supplies the log keeps an unwanted runtime event's correct digest but gives
it another type (0xA, 0x80000003, EV_NO_ACTION, ...). The old verifier replayed such an event's
logged digest as it stood, so the replay still matched the quote, while every named-event check
(compose-hash, the SSH keys, "exactly once", other_runtime_events: refuse) looked only at
runtime-typed events: the event vanished. Each test below was accepted by the old code.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from umbra.attest.atls import ATLSConnection, serve_atls
from umbra.attest.collateral import Collateral
from umbra.attest.errors import EventLogError
from umbra.attest.eventlog import (
    EV_NO_ACTION,
    EV_SEPARATOR,
    RUNTIME_EVENT_TYPE,
    Event,
    dump_ccel,
    load_event_log,
    parse_ccel,
    parse_dstack_event_log,
)
from umbra.attest.measurement import MeasurementPolicy, ssh_keys_digest
from umbra.attest.quote import parse_quote
from umbra.attest.quote_source import SimulatedSource
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import event_reasons, verify_quote

from .conftest import T_SIM, release_for

RETYPES = [0xA, 0x80000003, EV_NO_ACTION, 0x0, 0xFFFFFFFF]
HIDDEN = "LIUM_MINER_HOTKEY"  # a real runtime event of the dstack vector


def _retyped(e: Event, event_type: int) -> Event:
    """The forger's edit: same register, same digest, another type, no name."""
    return Event(e.imr, event_type, e.digest, "", b"", False)


def _dstack_policy(raw: bytes, names: set[str]) -> MeasurementPolicy:
    return MeasurementPolicy(release=release_for(raw, events=[{"name": n} for n in sorted(names)]))


@pytest.mark.parametrize("event_type", RETYPES)
def test_dstack_json_refuses_a_retyped_runtime_event(
    dstack_report: dict[str, Any], event_type: int
) -> None:
    doc = json.loads(dstack_report["event_log"])
    idx = next(i for i, e in enumerate(doc) if e["event"] == HIDDEN)
    doc[idx] = {"imr": 3, "event_type": event_type, "digest": doc[idx]["digest"], "event": ""}
    with pytest.raises(EventLogError, match="RTMR3 accepts only runtime events"):
        parse_dstack_event_log(json.dumps(doc))


def test_the_verifier_refuses_a_retyped_event_built_in_code(dstack_report: dict[str, Any]) -> None:
    """Events handed to Verifier.verify directly (not through a parser) get the same rule."""
    raw = bytes.fromhex(dstack_report["quote"])
    events = parse_dstack_event_log(dstack_report["event_log"])
    others = {e.name for e in events if e.event_type == RUNTIME_EVENT_TYPE} - {HIDDEN}
    policy = _dstack_policy(raw, others)  # other_runtime_events: refuse (the default)
    reasons: list[str] = []
    assert set(event_reasons(parse_quote(raw), policy, events, reasons)) == others
    assert reasons == ["runtime events not in the policy: " + HIDDEN]  # honest log: refused
    forged = [_retyped(e, 0xA) if e.name == HIDDEN else e for e in events]
    reasons = []
    assert event_reasons(parse_quote(raw), policy, forged, reasons) == []
    assert reasons == ["event of type 0xa on RTMR3: RTMR3 accepts only runtime events "
                       "(type 0x08000001)"]  # fmt: skip
    # A runtime event whose digest is not derived from its name and payload: same refusal.
    lying = [
        Event(e.imr, e.event_type, e.digest, "compose-hash", e.payload, True)
        if e.name == HIDDEN
        else e
        for e in events
    ]
    reasons = []
    event_reasons(parse_quote(raw), policy, lying, reasons)
    assert reasons == [
        "runtime event 'compose-hash' (RTMR3): digest does not match its name and payload"
    ]


def _sim_verify(pki: SimulatedPki, collateral: Collateral, tdx: SimulatedTdx, log: bytes) -> Any:
    policy = MeasurementPolicy(
        release=tdx.release_manifest(events=[{"name": "compose-hash", "payloads": ["aa" * 32]}])
    )
    return verify_quote(
        tdx.quote(b""),
        policy=policy,
        collateral=collateral,
        now=T_SIM,
        event_log=load_event_log(log),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )


@pytest.mark.parametrize("event_type", [t for t in RETYPES if t != EV_NO_ACTION])
def test_ccel_refuses_a_retyped_runtime_event(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx, event_type: int
) -> None:
    tdx.extend_runtime_event("compose-hash", b"\xaa" * 32)
    tdx.extend_runtime_event("debug-shell", b"on")  # the TD really ran this
    honest = dump_ccel(tdx.event_log())
    assert _sim_verify(pki, sim_collateral, tdx, honest).reasons == [
        "runtime events not in the policy: debug-shell"
    ]
    forged = [_retyped(e, event_type) if e.name == "debug-shell" else e for e in tdx.event_log()]
    with pytest.raises(EventLogError, match="RTMR3 accepts only runtime events"):
        parse_ccel(dump_ccel(forged))


def test_ccel_refuses_no_action_records_on_rtmr3_and_out_of_range_indices() -> None:
    """EV_NO_ACTION is skipped, never extended: not a way to carry anything on RTMR3, and no
    longer a way past the MR-index check."""
    header = dump_ccel([])
    no_action = EV_NO_ACTION.to_bytes(4, "little")
    for index, says in ((4, "RTMR3 accepts only runtime events"), (9, "not a measurement")):
        record = index.to_bytes(4, "little") + no_action + bytes(8)  # no digests, no data
        with pytest.raises(EventLogError, match=says):
            parse_ccel(header + record)
    assert parse_ccel(header + (0).to_bytes(4, "little") + no_action + bytes(8)) == []


def test_separator_on_rtmr3_is_refused_even_when_its_digest_is_right() -> None:
    sep = Event(3, EV_SEPARATOR, bytes(48), "", b"\0\0\0\0", True)
    with pytest.raises(EventLogError, match="RTMR3 accepts only runtime events"):
        parse_ccel(dump_ccel([sep]))


def _ssh_key() -> str:
    pub = Ed25519PrivateKey.generate().public_key()
    return pub.public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode()


def test_the_session_path_refuses_a_retyped_host_key_event(
    pki: SimulatedPki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `umbra ssh` runs (session_policy + CapturingVerifier + check_host_key over real aTLS
    on loopback). The TD bound its real host key, then something in it bound a second one; the
    log hides the first by re-typing it, so "exactly one umbra.ssh-host-key" held and the client
    learnt the second key. Now the log is refused before anything in it is believed."""
    from umbra.attest.session_info import SessionInfo
    from umbra.cli import ssh_attest
    from umbra.cli.ssh_attest import Check, Refused
    from umbra.contracts.session import (
        BOOT_ID_EVENT,
        CVM_ID_EVENT,
        SSH_HOST_KEY_EVENT,
        SessionState,
        SshIngress,
    )

    pki.save(tmp_path / "pki")
    monkeypatch.setenv(ssh_attest.SIMULATED_PKI_ENV, str(tmp_path / "pki"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    user, real_key, other_key = _ssh_key(), _ssh_key(), _ssh_key()
    tdx = SimulatedTdx(pki)
    tdx.extend_runtime_event(CVM_ID_EVENT, b"dev-alice-1")
    tdx.extend_runtime_event("umbra.ssh-authorized-keys", ssh_keys_digest([user]))
    tdx.extend_runtime_event(BOOT_ID_EVENT, b"0123456789abcdef" * 2)
    tdx.extend_runtime_event(SSH_HOST_KEY_EVENT, real_key.encode())
    tdx.extend_runtime_event(SSH_HOST_KEY_EVENT, other_key.encode())
    first = next(e for e in tdx.event_log() if e.name == SSH_HOST_KEY_EVENT)
    forged = [_retyped(e, 0xA) if e is first else e for e in tdx.event_log()]

    async def idle(conn: ATLSConnection) -> None:
        await conn.recv(1)

    async def connect() -> ssh_attest.AttestedSession:
        server = await serve_atls(
            "127.0.0.1",
            0,
            idle,
            SimulatedSource(tdx),
            event_log=lambda: forged,
            bind=lambda: other_key.encode(),
        )
        info = SessionInfo(
            cvm_id="dev-alice-1",
            name="main",
            state=SessionState.running,
            ingress=SshIngress(host="127.0.0.1", port=server.sockets[0].getsockname()[1]),
            release=tdx.release_manifest(),
            ssh_authorized_keys=[user],
        )
        try:
            session = await ssh_attest.connect_attested(info)
            await session.conn.close()
            return session
        finally:
            server.close()
            await server.wait_closed()

    with pytest.raises(Refused) as exc:
        asyncio.run(connect())
    assert exc.value.check is Check.atls
    assert "RTMR3 accepts only runtime events" in exc.value.reason


def test_named_events_live_on_rtmr3_only() -> None:
    """RTMR3 is the one register the policy treats as runtime; RTMR0-2 are pinned whole."""
    from pydantic import ValidationError

    from umbra.attest.measurement import ExpectedEvent

    assert ExpectedEvent(name="compose-hash").imr == 3
    with pytest.raises(ValidationError, match=r"RTMR3 \(imr: 3\) only"):
        ExpectedEvent(name="compose-hash", imr=1)


def test_a_named_runtime_event_on_another_register_is_not_the_named_one(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx
) -> None:
    """Before, "runtime events not in the policy" compared names only: a compose-hash event
    extended into RTMR1 escaped it (RTMR1 pinned or not)."""
    tdx.extend_runtime_event("compose-hash", b"\xaa" * 32)
    tdx.extend_runtime_event("compose-hash", b"\xbb" * 32, imr=1)
    verdict = _sim_verify(pki, sim_collateral, tdx, dump_ccel(tdx.event_log()))
    assert "runtime events not in the policy: compose-hash" in verdict.reasons
