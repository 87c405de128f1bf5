"""The emulated clouds' TDX module (umbra.emulated.tdx_module) and the guest's client of it
(umbra.attest.tdx_port): the launch agent's extender and the quoting interface, over a character
device as in the guest. Fast: no VM; a raw pty relayed to the module's unix socket plays the
virtio-serial port QEMU would connect (the same byte stream, the same file API in the guest)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from umbra.attest.collateral import StaticCollateral
from umbra.attest.errors import QuoteSourceError
from umbra.attest.eventlog import load_event_log, make_runtime_event, replay
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.quote import parse_quote
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.tdx_port import TDX_PORT_NAME, TdxModulePort, TdxModuleSource, find_port
from umbra.attest.verify import Verifier
from umbra.components.launch_data import LaunchData
from umbra.emulated.metadata import EmulatedMetadata, Shape
from umbra.emulated.qemu import VmConfig, qemu_argv
from umbra.emulated.tdx_module import TdxModule
from umbra.images.launch_agent import Agent, GcpMetadata, LaunchError, TdxModuleRtmr
from umbra.images.measure import measure

from ..sandbox.fixtures import dev_definition
from .port_relay import port_to

IMAGE = "umbra-dev-cvm-emulated"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice"


@pytest.fixture(scope="module")
def pki() -> SimulatedPki:
    return SimulatedPki.generate()


@pytest.fixture
def module(pki: SimulatedPki, tmp_path: Path) -> Iterator[TdxModule]:
    with TdxModule(tmp_path / "tdx.sock", pki, IMAGE).serving() as m:
        yield m


def _boot(module: TdxModule, n: int) -> SimulatedTdx:
    deadline = time.monotonic() + 5
    while len(module.boots) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return module.boots[n - 1]


def test_the_guests_extends_and_quote_verify_against_its_event_log(
    module: TdxModule, pki: SimulatedPki
) -> None:
    events = [make_runtime_event(3, "umbra.cvm-id", b"cvm_1"), make_runtime_event(3, "x", b"y")]
    with port_to(module) as path:
        extender = TdxModuleRtmr(TdxModulePort(path))
        for event in events:
            extender.extend(event)
        report_data = bytes(range(64))
        quote = TdxModuleSource(TdxModulePort(path)).get_quote(report_data)
        firmware = extender.firmware_events()
    td = _boot(module, 1)
    assert [e.imr for e in firmware] == [0, 0, 1, 1, 2, 2]  # the CCEL: RTMR0-2 only
    log = [*firmware, *events]  # what the launch agent writes for the services
    parsed = parse_quote(quote)
    assert parsed.td_report.report_data == report_data
    assert parsed.td_report.rtmrs[3] == replay(events)[3]
    # The module saw digests only: the names and payloads are in the guest's log.
    assert [e.name for e in td.event_log() if e.imr == 3] == ["", ""]
    release = SimulatedTdx(pki, image=IMAGE).release_manifest(
        events=[
            {"name": "umbra.cvm-id", "payloads": [b"cvm_1".hex()]},
            {"name": "x", "payloads": [b"y".hex()]},
        ]
    )
    policy = MeasurementPolicy(release=release)
    collateral = StaticCollateral(pki.collateral(int(time.time()) - 3600))
    simulated = Verifier(
        policy, collateral, allow_simulated=True, simulated_root_der=pki.root_der
    ).verify(quote, event_log=log, expected_report_data=report_data)
    assert simulated.ok, simulated.reasons
    assert simulated.simulated
    # A production verifier (no simulated root) refuses the same quote.
    strict = Verifier(policy, collateral).verify(quote, event_log=log)
    assert not strict.ok
    # So does one given the simulated root for a production (`tee: tdx`) release.
    tdx = MeasurementPolicy(release=release.model_copy(update={"tee": "tdx"}))
    refused = Verifier(tdx, collateral, True, pki.root_der).verify(quote, event_log=log)
    assert not refused.ok and not refused.simulated
    assert "does not end in the Intel SGX Root CA" in refused.reasons[0]
    # A log that does not replay to the quoted RTMR3 fails.
    forged = [*firmware, events[0]]
    assert not Verifier(policy, collateral, True, pki.root_der).verify(quote, event_log=forged).ok


def test_each_connection_is_a_new_boot_with_a_fresh_rtmr3(module: TdxModule) -> None:
    with port_to(module) as path:
        TdxModulePort(path).extend(3, make_runtime_event(3, "a", b"1").digest)
    with port_to(module) as path:
        quote = TdxModuleSource(TdxModulePort(path)).get_quote(bytes(64))
    assert parse_quote(quote).td_report.rtmrs[3] == bytes(48)  # the second boot extended nothing
    assert _boot(module, 1).rtmrs()[3] != bytes(48)
    assert module.requests == ["extend", "quote"]


def test_refusals_are_precise_and_nothing_is_extended(module: TdxModule) -> None:
    with port_to(module) as path:
        port = TdxModulePort(path, timeout=5)
        with pytest.raises(QuoteSourceError, match="only RTMR3 is extended"):
            port.extend(2, bytes(48))
        with pytest.raises(QuoteSourceError, match="digest must be 48 bytes"):
            port.extend(3, bytes(32))
        with pytest.raises(QuoteSourceError, match="report_data must be 64 bytes"):
            port.quote(bytes(10))
        with pytest.raises(QuoteSourceError, match="report_data must be 64 bytes"):
            TdxModuleSource(port).get_quote(bytes(10))
        # A torn line left by a killed client does not desynchronise the next exchange.
        fd = os.open(path, os.O_WRONLY)
        os.write(fd, b'{"id": "dead", "op": "quo\n')
        os.close(fd)
        assert len(port.quote(bytes(64))) > 1000
    assert _boot(module, 1).rtmrs()[3] == bytes(48)


def test_a_port_held_by_another_exchange_is_waited_for(
    module: TdxModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    """virtio_console admits one opener at a time: the next open gets EBUSY (before any flock).
    A client waits its turn within its timeout (a Dev CVM's forwarder re-enrolling while its
    ingress quotes for `umbra ssh`), and past it fails closed with the reason."""
    import errno

    from umbra.attest import tdx_port

    real_open, busy = os.open, [3]

    def held_open(path: str, flags: int, *args: int) -> int:
        if busy[0] > 0:
            busy[0] -= 1
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        return real_open(path, flags, *args)

    monkeypatch.setattr(tdx_port.os, "open", held_open)
    with port_to(module) as path:
        assert len(TdxModuleSource(TdxModulePort(path, timeout=5)).get_quote(bytes(64))) > 1000
        assert busy == [0]
        busy[0] = 10**6  # held for good
        with pytest.raises(QuoteSourceError, match="Device or resource busy"):
            TdxModulePort(path, timeout=0.3).quote(bytes(64))


def test_no_port_fails_closed(tmp_path: Path) -> None:
    port = TdxModulePort(tmp_path / "absent")
    with pytest.raises(QuoteSourceError, match="emulated-cloud VM"):
        TdxModuleSource(port).get_quote(bytes(64))
    with pytest.raises(LaunchError, match="emulated-cloud VM"):
        TdxModuleRtmr(port).extend(make_runtime_event(3, "a", b"1"))


def test_the_port_is_found_by_name_in_sysfs_without_udev(tmp_path: Path) -> None:
    for name, port in (("vport1p1", "org.qemu.guest_agent.0"), ("vport1p2", TDX_PORT_NAME)):
        (tmp_path / "sys" / name).mkdir(parents=True)
        (tmp_path / "sys" / name / "name").write_text(port + "\n")
    assert find_port(tmp_path / "sys", tmp_path / "dev") == tmp_path / "dev/vport1p2"


def test_qemu_gives_the_guest_the_port_only_with_a_module(tmp_path: Path) -> None:
    base = VmConfig(Shape.gcp, tmp_path / "d", tmp_path / "e", tmp_path / "s", tmp_path / "q", 1, 2)
    assert not any("virtserialport" in a for a in qemu_argv(base))
    argv = " ".join(qemu_argv(VmConfig(**{**base.__dict__, "tdx_module": tmp_path / "t.sock"})))
    assert f"socket,id=tdx,path={tmp_path / 't.sock'}" in argv
    assert f"virtserialport,bus=vs0.0,chardev=tdx,name={TDX_PORT_NAME}" in argv


class _Recorder:
    def __init__(self) -> None:
        self.started: list[Path] = []

    def start(self, compose: Path) -> None:
        self.started.append(compose)


def test_the_launch_agents_log_verifies_a_module_quote_as_the_services_present_it(
    pki: SimulatedPki, tmp_path: Path
) -> None:
    """What a guest with `--tee emulated` does: the agent extends RTMR3 through the port and
    writes the module's CCEL ahead of its events; the ingress and the forwarder serve that log
    with the module's quotes, and a verifier holding the release and the instance's binding
    accepts them."""
    m = measure(dev_definition())
    data = LaunchData(
        role="dev-cvm",
        team="team-a",
        cvm_id="dev-emulated-1",
        app_compose=m.app_compose.decode(),
        ssh_authorized_keys=(KEY,),
        cloud=Shape.gcp,
    )
    lines: list[str] = []
    starter = _Recorder()
    with (
        TdxModule(tmp_path / "tdx.sock", pki, "umbra-dev-cvm").serving() as module,
        EmulatedMetadata(Shape.gcp, data, "vm-1").serving() as stand_in,
        port_to(module) as path,
    ):
        rtmr = TdxModuleRtmr(TdxModulePort(path))
        Agent(
            source=GcpMetadata(f"http://127.0.0.1:{stand_in.metadata_port}"),
            extender=rtmr,
            starter=starter,
            reporter=None,
            launch_dir=tmp_path / "launch",
            say=lines.append,
            firmware_log=rtmr.firmware_events,
        ).run()
        nonce = os.urandom(64)
        quote = TdxModuleSource(TdxModulePort(path)).get_quote(nonce)
    assert starter.started, lines
    for served in ("event-log.json", "forwarder/event-log.json"):
        log = load_event_log((tmp_path / "launch" / served).read_bytes())
        verdict = Verifier(
            MeasurementPolicy(release=m.release, binding=m.binding(data.cvm_id, [KEY])),
            StaticCollateral(pki.collateral(int(time.time()) - 60)),
            allow_simulated=True,
            simulated_root_der=pki.root_der,
        ).verify(quote, event_log=log, expected_report_data=nonce)
        assert verdict.ok, (served, verdict.reasons)
