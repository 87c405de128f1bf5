"""The Security CVM's quote path on the emulated clouds: the launch agent's quotes-only relay
(attest.tdx_port.serve_quote_relay, `umbra image tdx-quote-relay`) between the proxy's socket and
the host's TDX module, and the proxy's `--quote-source emulated` evidence over it. Fast: a raw
pty relayed to the module plays the guest's virtio-serial port (tests/emulated/port_relay.py)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from umbra.attest.collateral import StaticCollateral
from umbra.attest.errors import QuoteSourceError
from umbra.attest.eventlog import dump_dstack_event_log, make_runtime_event
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.quote import parse_quote
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.tdx_port import (
    TdxModulePort,
    TdxQuoteSocketSource,
    quote_relay_answer,
    serve_quote_relay,
)
from umbra.attest.verify import Verifier
from umbra.emulated.tdx_module import TdxModule
from umbra.proxy.tunnel_quote import EvidenceError, build_evidence
from umbra.sandbox.validate import ComposeError

from ..sandbox.fixtures import security_definition
from .port_relay import port_to

IMAGE = "umbra-security-cvm"


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[Path, TdxModule, SimulatedPki, TdxModulePort]]:
    pki = SimulatedPki.generate()
    with TdxModule(tmp_path / "tdx.sock", pki, IMAGE).serving() as module, port_to(module) as dev:
        port = TdxModulePort(dev, timeout=10)
        sock = tmp_path / "tdx-quote.sock"
        threading.Thread(target=serve_quote_relay, args=(sock, port), daemon=True).start()
        deadline = time.monotonic() + 5
        while not sock.is_socket() and time.monotonic() < deadline:
            time.sleep(0.01)
        yield sock, module, pki, port


def test_the_proxy_quotes_through_the_relay_and_a_verifier_replays_the_agents_log(
    relay: tuple[Path, TdxModule, SimulatedPki, TdxModulePort], tmp_path: Path
) -> None:
    sock, module, pki, port = relay
    assert sock.stat().st_mode & 0o777 == 0o600  # the proxy's uid alone (root in this test)
    # The launch agent measures into the module, and writes the log with the CCEL first.
    events = [make_runtime_event(3, "umbra.cvm-id", b"cvm_sec")]
    for event in events:
        port.extend(3, event.digest)
    log = [*port.firmware_events(), *events]
    (tmp_path / "event-log.json").write_text(dump_dstack_event_log(log))
    source, served = build_evidence(
        "emulated", event_log=tmp_path / "event-log.json", tdx_quote_socket=sock
    )
    assert served is not None and list(served()) == log
    report_data = bytes(range(64))
    quote = source.get_quote(report_data)
    assert parse_quote(quote).td_report.report_data == report_data
    release = SimulatedTdx(pki, image=IMAGE).release_manifest(
        events=[{"name": "umbra.cvm-id", "payloads": [b"cvm_sec".hex()]}]
    )
    collateral = StaticCollateral(pki.collateral(int(time.time()) - 3600))
    policy = MeasurementPolicy(release=release)
    verdict = Verifier(policy, collateral, True, pki.root_der).verify(
        quote, event_log=list(served()), expected_report_data=report_data
    )
    assert verdict.ok and verdict.simulated, verdict.reasons
    assert not Verifier(policy, collateral).verify(quote, event_log=log).ok  # production refuses
    assert module.requests == ["extend", "ccel", "quote"]


def test_the_relay_serves_quotes_only(
    relay: tuple[Path, TdxModule, SimulatedPki, TdxModulePort],
) -> None:
    sock, module, _pki, port = relay
    requests: list[object] = [
        {"op": "extend", "rtmr": 3, "digest": "00" * 48},  # a container never moves RTMR3
        {"report_data": "00" * 64, "op": "extend"},
        {"report_data": "00" * 10},
        {"report_data": "zz"},
        [],
    ]
    for request in requests:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock))
            s.sendall(json.dumps(request).encode() + b"\n")
            answer = json.loads(s.makefile("rb").readline())
        assert set(answer) == {"error"}, (request, answer)
    assert quote_relay_answer(b"not json", port) == {
        "error": 'want one line {"report_data": 64 bytes in hex}'
    }
    assert "extend" not in module.requests and "quote" not in module.requests
    with pytest.raises(QuoteSourceError, match="report_data must be 64 bytes"):
        TdxQuoteSocketSource(sock).get_quote(bytes(3))


def test_no_relay_fails_closed_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(QuoteSourceError, match="the launch agent's TDX quote relay"):
        TdxQuoteSocketSource(tmp_path / "none.sock", timeout=2).get_quote(bytes(64))
    with pytest.raises(EvidenceError, match="--tdx-quote-socket"):
        build_evidence("emulated")
    with pytest.raises(EvidenceError, match="--tdx-quote-socket"):
        build_evidence("configfs", tdx_quote_socket=tmp_path / "x.sock")


def test_an_emulated_release_renders_the_relay_and_only_a_simulated_one_may() -> None:
    from umbra.images.measure import measure
    from umbra.sandbox.validate import validate_security_compose

    text = measure(security_definition(simulated={"source": "emulated"})).compose.text
    assert '"--quote-source", "emulated", "--tdx-quote-socket", ' in text
    assert '"/run/umbra/launch/tdx-quote.sock"' in text
    assert "/sys/kernel/config/tsm/report" not in text and "--simulated-pki" not in text
    # A configfs (production) file may not carry the relay's flag.
    tdx = measure(security_definition()).compose.text
    bad = tdx.replace('"--quote-source", "configfs"',
                      '"--quote-source", "configfs", "--tdx-quote-socket", "/run/umbra/launch/x"')  # fmt: skip
    with pytest.raises(ComposeError, match="--tdx-quote-socket only in a simulated release"):
        validate_security_compose(bad)
    outside = text.replace('"/run/umbra/launch/tdx-quote.sock"', '"/tmp/tdx-quote.sock"')
    with pytest.raises(ComposeError, match="--tdx-quote-socket must be in the launch directory"):
        validate_security_compose(outside)
