"""Golden values are recomputed here from the rendered files, independently of images.measure,
and a simulated TD that extends exactly those events verifies against the emitted manifest."""

from __future__ import annotations

import hashlib
import json
import struct
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from umbra.attest.collateral import StaticCollateral
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verifier
from umbra.images.definition import DefinitionError, parse_definition
from umbra.images.manifest import build_manifest
from umbra.images.measure import (
    CVM_ID_EVENT,
    boot_events,
    boot_events_of,
    expected_rtmr3,
    instance_events,
    measure,
)
from umbra.images.signing import SignatureError, sign_manifest, verify_signed_manifest
from umbra.sandbox.dev_definition import render_dev_host

from ..sandbox.fixtures import dev_definition, dev_definition_doc, security_definition

ALICE = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice@laptop"
)
BOB = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHp3bO0b7kl6pVF5rSqMXh2XSE8C3cJ2kQ5vZ5m7y2Xb bob"


def _runtime_digest(name: str, payload: bytes) -> bytes:
    # Written out again from dstack's definition, so a slip in either copy shows.
    return hashlib.sha384(
        struct.pack("<I", 0x08000001) + b":" + name.encode() + b":" + payload
    ).digest()


def test_compose_hash_recomputed_from_the_rendered_file() -> None:
    m = measure(dev_definition())
    text = render_dev_host(dev_definition().host).text
    app = json.dumps(
        {
            "dev_cvm_host": text,
            "manifest_version": 2,
            "name": "dev-cvm-test",
            "runner": "umbra-dev-host",
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    assert m.app_compose == app
    assert m.compose_hash == hashlib.sha256(app).digest()
    compose_event = next(e for e in m.release.events if e.name == "compose-hash")
    assert compose_event.payloads == [hashlib.sha256(app).hexdigest()]
    assert m.events()[0].digest == _runtime_digest("compose-hash", hashlib.sha256(app).digest())


def test_measurement_is_deterministic_and_input_sensitive() -> None:
    a = build_manifest(measure(dev_definition())).canonical()
    b = build_manifest(measure(dev_definition())).canonical()
    assert a == b
    other = build_manifest(measure(dev_definition(tunnels=[]))).canonical()
    assert other != a
    # The Security CVM's golden values are part of the Dev CVM's compose hash.
    sec = measure(security_definition(tunnel_port=9443)).release
    changed = dev_definition(security_cvm_release=sec.model_dump(mode="json", exclude_none=True))
    assert measure(changed).compose_hash != measure(dev_definition()).compose_hash


def test_expected_rtmr3_with_launch_bound_ssh_keys() -> None:
    m = measure(dev_definition())
    events = m.events() + instance_events("dev-cvm", "dev-alice-1", [ALICE, BOB + " extra"])
    keys = "\n".join(sorted([" ".join(ALICE.split()[:2]), " ".join(BOB.split()[:2])])).encode()
    mr = bytes(48)
    for name, payload in [
        ("compose-hash", m.compose_hash),
        (CVM_ID_EVENT, b"dev-alice-1"),
        ("umbra.ssh-authorized-keys", hashlib.sha256(keys).digest()),
    ]:
        mr = hashlib.sha384(mr + _runtime_digest(name, payload)).digest()
    assert expected_rtmr3(events) == mr
    # Key order, comments and duplicates do not matter; a different key does.
    same = m.events() + instance_events("dev-cvm", "dev-alice-1", [BOB, ALICE, ALICE])
    assert expected_rtmr3(same) == mr
    other = m.events() + instance_events("dev-cvm", "dev-alice-1", [ALICE])
    assert expected_rtmr3(other) != mr
    with pytest.raises(ValueError, match="at least one SSH"):
        instance_events("dev-cvm", "dev-alice-1", [])


@pytest.fixture(scope="module")
def pki() -> SimulatedPki:
    return SimulatedPki.generate()


def _verify(pki: SimulatedPki, tdx: SimulatedTdx, policy: MeasurementPolicy) -> list[str]:
    now = int(time.time())
    verifier = Verifier(
        policy,
        StaticCollateral(pki.collateral(now - 60)),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    rd = bytes(range(64))
    verdict = verifier.verify(
        tdx.quote(rd), event_log=tdx.event_log(), expected_report_data=rd, now=now
    )
    return verdict.reasons


def test_golden_values_verify_a_td_that_launched_them(pki: SimulatedPki) -> None:
    m = measure(dev_definition())
    launched = m.events() + instance_events("dev-cvm", "dev-alice-1", [ALICE])
    good = MeasurementPolicy(release=m.release, binding=m.binding("dev-alice-1", [ALICE]))
    # A Dev CVM that never measured its boot id and host key is refused on exactly those.
    bare = SimulatedTdx(pki, image="umbra-dev-cvm")
    for e in launched:
        bare.extend_runtime_event(e.name, e.payload)
    reasons = _verify(pki, bare, good)
    assert len(reasons) == 2 and all("umbra.boot-id" in r or "ssh-host-key" in r for r in reasons)
    tdx = SimulatedTdx(pki, image="umbra-dev-cvm")
    booted = launched + boot_events("dev-cvm", "ab" * 16, BOB)
    for e in booted:
        tdx.extend_runtime_event(e.name, e.payload)
    assert tdx.rtmrs()[3] == expected_rtmr3(booted)
    assert boot_events_of("dev-cvm", tdx.event_log()) == ("ab" * 16, BOB.rsplit(" ", 1)[0])
    assert _verify(pki, tdx, good) == []
    # The CLI's SSH-key check: a binding with other keys fails on exactly that event.
    wrong = MeasurementPolicy(release=m.release, binding=m.binding("dev-alice-1", [BOB]))
    reasons = _verify(pki, tdx, wrong)
    assert reasons and all("umbra.ssh-authorized-keys" in r for r in reasons), reasons


K = BOB.encode()


@pytest.mark.parametrize(
    ("what", "tail", "match"),
    [
        ("missing", [], "does not end with"),
        ("out of order", [("umbra.ssh-host-key", K), ("umbra.boot-id", b"ab" * 16)], "end with"),
        ("short id", [("umbra.boot-id", b"ab" * 8), ("umbra.ssh-host-key", K)], "16 bytes"),
        ("comment", [("umbra.boot-id", b"ab" * 16), ("umbra.ssh-host-key", K)], "canonical"),
        ("no key", [("umbra.boot-id", b"ab" * 16), ("umbra.ssh-host-key", b"x")], "OpenSSH"),
    ],
)
def test_per_boot_events_are_read_only_in_their_one_form(
    pki: SimulatedPki, what: str, tail: list[tuple[str, bytes]], match: str
) -> None:
    tdx = SimulatedTdx(pki, image="umbra-dev-cvm")
    for e in instance_events("dev-cvm", "x", [ALICE]):
        tdx.extend_runtime_event(e.name, e.payload)
    for name, payload in tail:
        tdx.extend_runtime_event(name, payload)
    with pytest.raises(ValueError, match=match):
        boot_events_of("dev-cvm", tdx.event_log())
    assert boot_events_of("security-cvm", tdx.event_log()) is None, what


def test_a_td_with_another_compose_fails(pki: SimulatedPki) -> None:
    m = measure(dev_definition())
    other = measure(dev_definition(tunnels=[]))
    tdx = SimulatedTdx(pki, image="umbra-dev-cvm")
    for e in other.events() + instance_events("dev-cvm", "x", [ALICE]):
        tdx.extend_runtime_event(e.name, e.payload)
    reasons = _verify(
        pki, tdx, MeasurementPolicy(release=m.release, binding=m.binding("x", [ALICE]))
    )
    assert any("compose-hash" in r for r in reasons), reasons


def test_signed_manifest_round_trip_and_tamper() -> None:
    key = Ed25519PrivateKey.generate()
    manifest = build_manifest(measure(security_definition()))
    signed = sign_manifest(manifest, key)
    assert verify_signed_manifest(signed, [key.public_key()]) == manifest
    doc = json.loads(signed)
    doc["manifest"]["compose_hash"] = "0" * 64
    with pytest.raises(SignatureError, match="altered"):
        verify_signed_manifest(json.dumps(doc), [key.public_key()])
    with pytest.raises(SignatureError, match="not pinned"):
        verify_signed_manifest(signed, [Ed25519PrivateKey.generate().public_key()])


def test_a_real_tdx_release_cannot_accept_simulated_security_cvms() -> None:
    doc = dev_definition_doc(allow_simulated=True)
    doc["tee"] = "tdx"
    doc["base"] = {r: ["00" * 48] for r in ("mrtd", "rtmr0", "rtmr1", "rtmr2")}
    with pytest.raises(DefinitionError, match="must not let its forwarder accept simulated"):
        parse_definition(doc)
    doc["host"]["allow_simulated"] = False
    assert parse_definition(doc).tee == "tdx"
    # Nor quote its enrollment with the emulated clouds' simulated TDX module.
    doc["host"]["quote_source"] = "emulated"
    with pytest.raises(DefinitionError, match="quotes with configfs-tsm, not 'emulated'"):
        parse_definition(doc)


def test_an_emulated_release_measures_its_forwarders_quote_source() -> None:
    """`quote_source: emulated` reaches the measured forwarder config and changes the compose
    hash; the default is configfs-tsm, byte for byte what releases measured before."""
    default = measure(dev_definition())
    emulated = measure(dev_definition(quote_source="emulated"))
    host = json.loads(json.loads(emulated.app_compose)["dev_cvm_host"])
    assert host["forwarder"]["enrollment"]["quote_source"] == "emulated"
    plain = json.loads(json.loads(default.app_compose)["dev_cvm_host"])
    assert plain["forwarder"]["enrollment"]["quote_source"] == "configfs"
    assert default.app_compose != emulated.app_compose
