"""The sandbox topology with real network namespaces, a real forwarder and real aTLS.

    sandbox ns  10.200.1.2 ──veth── 10.200.1.1  forwarder ns  10.200.2.1 ──veth── 10.200.2.2  security ns
    (no default route, no IPv6)      (ip_forward = 0)           fd00:200:2::1     fd00:200:2::2

The security namespace runs a simulated TD's aTLS server (golden values from images.measure) that
records each identity header and answers as a stand-in proxy, plus plain TCP/UDP decoys.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from umbra.attest.atls import ATLSConnection, serve_atls
from umbra.attest.collateral import StaticCollateral
from umbra.attest.errors import ATLSError, QuoteSourceError
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.quote_source import SimulatedSource
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verifier
from umbra.contracts.tunnel_header import TunnelHeader, read_header
from umbra.images.measure import Measurement, instance_events, measure
from umbra.sandbox.dev_definition import render_dev_host
from umbra.sandbox.forwarder import Forwarder
from umbra.sandbox.models import Endpoint, Tunnel

from .fixtures import dev_definition, security_definition
from .netns import (
    LoopIn,
    ip,
    ip_may_fail,
    namespaces,
    require_netns,
    run_in,
    set_sysctls,
    veth,
)

SEC, FWD_IN, FWD_OUT, SBX = "10.200.2.2", "10.200.1.1", "10.200.2.1", "10.200.1.2"
SEC6 = "fd00:200:2::2"
CREDENTIAL = "forwarder-credential-0123456789"


@pytest.fixture(scope="module")
def pki() -> SimulatedPki:
    return SimulatedPki.generate()


@pytest.fixture(scope="module")
def sec_measurement() -> Measurement:
    return measure(security_definition())


def attested_td(pki: SimulatedPki, m: Measurement) -> SimulatedTdx:
    tdx = SimulatedTdx(pki, image="umbra-security-cvm")
    for e in m.events() + instance_events("security-cvm", "sec-team-a"):
        tdx.extend_runtime_event(e.name, e.payload)
    return tdx


@dataclass
class SecurityCvm:
    """Stand-in for the tunnel endpoint + proxy: records headers, echoes with the identity."""

    headers: list[TunnelHeader] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    atls_errors: list[ATLSError] = field(default_factory=list)
    udp: list[bytes] = field(default_factory=list)

    async def handle(self, conn: ATLSConnection) -> None:
        header, rest = await read_header(conn.recv)
        self.headers.append(header)
        data = rest or await conn.recv()
        self.payloads.append(data)
        await conn.send(f"proxy saw {header.cvm_id}/{header.mode}: ".encode() + data)


@dataclass
class Topology:
    ns: dict[str, str]
    sec_loop: LoopIn
    fwd_loop: LoopIn
    sec: SecurityCvm
    forwarder: Forwarder
    tdx: SimulatedTdx

    def sandbox[R](self, fn: Callable[[], R]) -> R:
        return run_in(self.ns["sandbox"], fn)


def _verifier(pki: SimulatedPki, m: Measurement) -> Verifier:
    return Verifier(
        MeasurementPolicy(release=m.release),
        StaticCollateral(pki.collateral(int(time.time()) - 60)),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )


def make_forwarder(verifier: Verifier, sec_port: int = 8443, proxy_port: int = 3128) -> Forwarder:
    main = proxy_port == 3128  # extra forwarders in one test get only a proxy listener
    return Forwarder(
        cvm_id="dev-alice-1",
        security_cvm=Endpoint(host=SEC, port=sec_port),
        verifier=verifier,
        listen_host=FWD_IN,
        proxy_port=proxy_port,
        tunnels=[Tunnel(name="github-ssh", listen_port=2201, host="github.com", port=22)]
        if main
        else [],
        credential=CREDENTIAL,
        connect_timeout=2,
        handshake_timeout=15,
    )


async def _decoys(sec: SecurityCvm) -> list[asyncio.AbstractServer]:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"decoy:" + await r.read(1024))
        await w.drain()
        w.close()

    class Udp(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            sec.udp.append(data)

    loop = asyncio.get_running_loop()
    await loop.create_datagram_endpoint(Udp, local_addr=(SEC, 53))
    return [
        await asyncio.start_server(echo, SEC, 9000),
        await asyncio.start_server(echo, SEC6, 9000),
    ]


@pytest.fixture
def topo(pki: SimulatedPki, sec_measurement: Measurement) -> Iterator[Topology]:
    require_netns()
    with namespaces("sandbox", "fwd", "sec") as ns:
        veth(ns["sandbox"], "sb0", f"{SBX}/24", ns["fwd"], "fw0", f"{FWD_IN}/24")
        veth(
            ns["fwd"],
            "fw1",
            f"{FWD_OUT}/24,fd00:200:2::1/64",
            ns["sec"],
            "se0",
            f"{SEC}/24,{SEC6}/64",
        )
        # The sandbox gets no IPv6 at all, as Docker does for enable_ipv6: false.
        set_sysctls(
            ns["sandbox"],
            {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"},
        )
        sec = SecurityCvm()
        tdx = attested_td(pki, sec_measurement)
        sec_loop, fwd_loop = LoopIn(ns["sec"]), LoopIn(ns["fwd"])
        try:
            sec_loop.run(
                serve_atls(
                    SEC,
                    8443,
                    sec.handle,
                    SimulatedSource(tdx),
                    event_log=tdx.event_log,
                    on_error=sec.atls_errors.append,
                )
            )
            sec_loop.run(_decoys(sec))
            fwd = make_forwarder(_verifier(pki, sec_measurement))
            fwd_loop.run(fwd.start())
            yield Topology(ns, sec_loop, fwd_loop, sec, fwd, tdx)
        finally:
            fwd_loop.stop()
            sec_loop.stop()


def exchange(host: str, port: int, data: bytes, timeout: float = 20) -> bytes | OSError:
    """A TCP round trip from the calling thread's namespace: the reply, or the error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
        s.sendall(data)
        out = b""
        while chunk := s.recv(4096):
            out += chunk
            if out.endswith(b"\n"):
                break
        return out
    except OSError as exc:
        return exc
    finally:
        s.close()


def _errno(result: bytes | OSError) -> int | None:
    return result.errno if isinstance(result, OSError) else None


def test_sandbox_has_no_route_but_the_forwarder(topo: Topology) -> None:
    routes = ip("-n", topo.ns["sandbox"], "route", "show").strip().splitlines()
    assert routes == [f"10.200.1.0/24 dev sb0 proto kernel scope link src {SBX} "] or [
        r.strip() for r in routes
    ] == [f"10.200.1.0/24 dev sb0 proto kernel scope link src {SBX}"]
    # Route lookups only: nothing is sent. Documentation and public resolver addresses alike.
    for dest in ("192.0.2.1", "8.8.8.8", "1.1.1.1", SEC, FWD_OUT):
        done = ip_may_fail("-n", topo.ns["sandbox"], "route", "get", dest)
        assert done.returncode != 0 and "unreachable" in done.stderr, (dest, done.stdout)
    done = ip_may_fail("-n", topo.ns["sandbox"], "-6", "route", "get", "2001:db8::1")
    assert done.returncode != 0


def test_direct_connections_elsewhere_fail(topo: Topology) -> None:
    def attempts() -> list[int | None]:
        return [
            _errno(exchange(SEC, 9000, b"hi\n")),  # a live server one hop further
            _errno(exchange(FWD_OUT, 2222, b"hi\n")),  # the forwarder's uplink side
            _errno(exchange(SEC6, 9000, b"hi\n")),  # IPv6
        ]

    codes = topo.sandbox(attempts)
    assert codes[:2] == [errno.ENETUNREACH, errno.ENETUNREACH]
    assert codes[2] in (errno.ENETUNREACH, errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)
    # And the servers really are up: from the forwarder's namespace they answer.
    assert run_in(topo.ns["fwd"], lambda: exchange(SEC, 9000, b"hi\n")) == b"decoy:hi\n"


def test_udp_and_dns_never_leave(topo: Topology) -> None:
    query = bytes.fromhex("abcd01000001000000000000076578616d706c6503636f6d0000010001")

    def attempts() -> list[int | None]:
        out: list[int | None] = []
        for host, port in ((SEC, 53), (FWD_IN, 53), (FWD_IN, 3128)):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.settimeout(2)
            try:
                s.connect((host, port))
                s.send(query)
                s.recv(512)
                out.append(None)
            except OSError as exc:
                out.append(exc.errno if exc.errno is not None else -1)
            finally:
                s.close()
        return out

    codes = topo.sandbox(attempts)
    assert codes[0] == errno.ENETUNREACH  # the "outside" resolver: no route at all
    # The forwarder has no UDP socket: the kernel answers port unreachable, on 53 and 3128 alike.
    assert codes[1:] == [errno.ECONNREFUSED, errno.ECONNREFUSED]
    assert topo.sec.udp == []
    assert topo.sec.headers == []


def test_through_the_forwarder_only_after_attestation(topo: Topology) -> None:
    # The sandbox's first bytes imitate an identity header: they arrive as payload, not identity.
    fake = b'\x00\x00\x00\x1f{"v":1,"cvm_id":"mallory","mode":"proxy"}\n'
    replies = topo.sandbox(
        lambda: [
            exchange(FWD_IN, 3128, b"CONNECT example.com:443 HTTP/1.1\r\n\n"),
            exchange(FWD_IN, 2201, b"SSH-2.0-test\n"),
            exchange(FWD_IN, 3128, fake),
        ]
    )
    assert replies[0] == b"proxy saw dev-alice-1/proxy: CONNECT example.com:443 HTTP/1.1\r\n\n"
    assert replies[1] == b"proxy saw dev-alice-1/tunnel: SSH-2.0-test\n"
    assert replies[2] == b"proxy saw dev-alice-1/proxy: " + fake
    h = topo.sec.headers
    assert [x.cvm_id for x in h] == ["dev-alice-1"] * 3
    assert (h[1].mode, h[1].tunnel, h[1].host, h[1].port) == (
        "tunnel",
        "github-ssh",
        "github.com",
        22,
    )
    assert all(x.credential == CREDENTIAL for x in h)
    assert topo.forwarder.stats.relayed == 3 and topo.forwarder.stats.refused == {}


def test_reconnect_is_reverified_and_fails_closed(topo: Topology) -> None:
    first = topo.sandbox(lambda: exchange(FWD_IN, 3128, b"one\n"))
    assert first == b"proxy saw dev-alice-1/proxy: one\n"
    # The Security CVM now runs something its golden values do not name.
    topo.tdx.extend_runtime_event("unexpected", b"payload")
    second = topo.sandbox(lambda: exchange(FWD_IN, 3128, b"two\n"))
    assert second == b"" or _errno(second) in (errno.ECONNRESET, errno.EPIPE)
    assert topo.sec.payloads == [b"one\n"]  # not one byte of the second connection got there
    assert topo.forwarder.stats.refused == {"attestation_failed": 1}
    # The Security CVM learns of the refusal from the VERDICT frame, on its own schedule.
    end = time.monotonic() + 10
    while not topo.sec.atls_errors and time.monotonic() < end:
        time.sleep(0.05)
    assert any("refused our attestation" in str(e) for e in topo.sec.atls_errors)


def test_wrong_security_cvm_is_refused(topo: Topology, pki: SimulatedPki) -> None:
    other = measure(security_definition(tunnel_port=9443))  # another compose, another hash
    fwd2 = make_forwarder(_verifier(pki, other), proxy_port=3130)
    topo.fwd_loop.run(fwd2.start())
    try:
        reply = topo.sandbox(lambda: exchange(FWD_IN, 3130, b"secret\n"))
        assert reply == b"" or _errno(reply) in (errno.ECONNRESET, errno.EPIPE)
        assert fwd2.stats.refused == {"attestation_failed": 1}
        assert topo.sec.payloads == [] and topo.sec.headers == []
    finally:
        topo.fwd_loop.run(fwd2.close())


def test_security_cvm_down_or_unreachable_fails_closed(
    topo: Topology, pki: SimulatedPki, sec_measurement: Measurement
) -> None:
    down = make_forwarder(_verifier(pki, sec_measurement), sec_port=8449, proxy_port=3131)
    topo.fwd_loop.run(down.start())
    try:
        reply = topo.sandbox(lambda: exchange(FWD_IN, 3131, b"x\n"))
        assert reply == b"" or _errno(reply) in (errno.ECONNRESET, errno.EPIPE)
        assert down.stats.refused == {"security_cvm_unreachable": 1}
        # A silent network (link down) is refused too, after the connect timeout.
        ip("-n", topo.ns["fwd"], "link", "set", "fw1", "down")
        started = time.monotonic()
        reply = topo.sandbox(lambda: exchange(FWD_IN, 3128, b"y\n"))
        assert reply == b"" or _errno(reply) in (errno.ECONNRESET, errno.EPIPE)
        assert time.monotonic() - started < 10
        assert topo.forwarder.stats.refused == {"security_cvm_unreachable": 1}
        assert topo.sec.payloads == []
    finally:
        topo.fwd_loop.run(down.close())


def test_root_in_the_sandbox_adding_a_route_gains_nothing(topo: Topology) -> None:
    # Root in the sandbox can change its own routes; the forwarder namespace still routes nothing.
    ip("-n", topo.ns["sandbox"], "route", "add", "default", "via", FWD_IN)
    replies = topo.sandbox(
        lambda: [exchange(SEC, 9000, b"out\n", timeout=2), exchange(FWD_OUT, 2222, b"SSH-2.0-x\n")]
    )
    assert isinstance(replies[0], TimeoutError)  # dropped: ip_forward is 0 in the forwarder ns
    forwarding = ip("netns", "exec", topo.ns["fwd"], "cat", "/proc/sys/net/ipv4/ip_forward")
    assert forwarding.strip() == "0"
    # The forwarder's own uplink address is local to it, but nothing listens there: the
    # forwarder binds only its sandbox address (no relay of any kind on the uplink side).
    assert _errno(replies[1]) == errno.ECONNREFUSED
    assert topo.forwarder.stats.refused == {}


def _listening(ns: str, host: str, port: int) -> bool:
    addr = int.from_bytes(bytes(int(x) for x in host.split(".")), "little")
    want = f"{addr:08X}:{port:04X}"
    table = subprocess.run(
        ["ip", "netns", "exec", ns, "cat", "/proc/net/tcp"], capture_output=True, text=True
    ).stdout
    return any(
        line.split()[1] == want and line.split()[3] == "0A" for line in table.splitlines()[1:]
    )


def test_cli_forwarder_runs_from_its_rendered_config(
    topo: Topology, pki: SimulatedPki, sec_measurement: Measurement, tmp_path: Path
) -> None:
    """`umbra forwarder serve` as its own process in the forwarder namespace, configured by the
    forwarder config of a rendered Dev CVM host definition (dev-cvm.json)."""
    release = sec_measurement.release.model_dump(mode="json", exclude_none=True)
    # The rendered name, which nothing in the forwarder's namespace resolves (a cloud Dev CVM has
    # no DNS): the forwarder dials the launch agent's address file (fails on the code before).
    d = dev_definition(
        security_cvm={"host": "security-cvm.umbra.internal", "port": 8443},
        security_cvm_release=release,
        allow_simulated=True,
    )
    cfg = json.loads(render_dev_host(d.host).text)["forwarder"]
    # Only a proxy listener: the module's in-process forwarder holds this namespace's others.
    cfg["listen"] = {"host": FWD_IN, "proxy_port": 3140, "tunnels": []}
    assert "ingress" not in cfg  # SSH is the attested ingress's, not a forwarder relay
    # The CA fetch has its own test (tests/proxy/test_sandbox_ca.py); this stand-in relays only.
    assert cfg.pop("sandbox_ca")["file"].startswith("/var/lib/umbra/data/dev-host/sandbox-ca/")
    # So does the sandbox environment's (tests/images/test_dev_host.py): a path of the CVM's.
    assert cfg.pop("sandbox_env")["file"] == "/var/lib/umbra/data/dev-host/sandbox-etc/sandbox.env"
    (tmp_path / "collateral.json").write_text(pki.collateral(int(time.time()) - 60).json_text)
    (tmp_path / "root.der").write_bytes(pki.root_der)
    (tmp_path / "cvm-id").write_text("dev-bob-7\n")
    (tmp_path / "credential").write_text(CREDENTIAL + "\n")
    (tmp_path / "security-cvm-ips").write_text(SEC + "\n")
    assert cfg["security_cvm_ips_file"] == "/run/umbra/launch/forwarder/security-cvm-ips"
    cfg.update(
        security_cvm_ips_file=str(tmp_path / "security-cvm-ips"),
        collateral={"file": str(tmp_path / "collateral.json")},
        simulated_root=str(tmp_path / "root.der"),
        cvm_id_file=str(tmp_path / "cvm-id"),
        credential_file=str(tmp_path / "credential"),
    )
    (tmp_path / "forwarder.json").write_text(json.dumps(cfg))
    umbra = Path(sys.executable).parent / "umbra"
    proc = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            topo.ns["fwd"],
            str(umbra),
            "forwarder",
            "serve",
            "-c",
            str(tmp_path / "forwarder.json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        end = time.monotonic() + 90
        while not _listening(topo.ns["fwd"], FWD_IN, 3140):
            assert proc.poll() is None, proc.communicate()[0].decode()
            assert time.monotonic() < end, "forwarder did not start listening"
            time.sleep(0.2)
        reply = topo.sandbox(lambda: exchange(FWD_IN, 3140, b"hello\n"))
        assert reply == b"proxy saw dev-bob-7/proxy: hello\n"
        assert topo.sec.headers[-1].credential == CREDENTIAL
    finally:
        proc.terminate()
        proc.wait(10)


class _NoQuotes:
    """A Security CVM whose TEE cannot produce quotes (attestation unavailable)."""

    simulated = True

    def get_quote(self, report_data: bytes) -> bytes:
        raise QuoteSourceError("configfs-tsm unavailable")


def test_attestation_unavailable_or_stalled_fails_closed(
    topo: Topology, pki: SimulatedPki, sec_measurement: Measurement
) -> None:
    async def tarpit(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read(1 << 16)  # accepts TCP, never answers TLS
        await asyncio.sleep(30)

    topo.sec_loop.run(serve_atls(SEC, 8451, topo.sec.handle, _NoQuotes()))
    topo.sec_loop.run(asyncio.start_server(tarpit, SEC, 8452))
    no_quote = make_forwarder(_verifier(pki, sec_measurement), sec_port=8451, proxy_port=3132)
    stalled = make_forwarder(_verifier(pki, sec_measurement), sec_port=8452, proxy_port=3133)
    stalled.handshake_timeout = 1
    for f in (no_quote, stalled):
        topo.fwd_loop.run(f.start())
    try:
        replies = topo.sandbox(
            lambda: [exchange(FWD_IN, 3132, b"a\n"), exchange(FWD_IN, 3133, b"b\n")]
        )
        for reply in replies:
            assert reply == b"" or _errno(reply) in (errno.ECONNRESET, errno.EPIPE)
        assert no_quote.stats.refused == {"attestation_failed": 1}
        assert stalled.stats.refused == {"attestation_failed": 1}
        assert topo.sec.payloads == [] and topo.sec.headers == []
    finally:
        for f in (no_quote, stalled):
            topo.fwd_loop.run(f.close())


def test_connection_limit_refuses_the_excess(
    topo: Topology, pki: SimulatedPki, sec_measurement: Measurement
) -> None:
    one = make_forwarder(_verifier(pki, sec_measurement), proxy_port=3134)
    one.max_connections = 1

    def scenario() -> list[bytes | OSError]:
        held = socket.create_connection((FWD_IN, 3134), timeout=20)
        try:
            end = time.monotonic() + 20
            while one.stats.relayed < 1 and time.monotonic() < end:  # attested and waiting
                time.sleep(0.05)
            second = exchange(FWD_IN, 3134, b"second\n")
            held.sendall(b"first\n")
            first = held.recv(4096)
        finally:
            held.close()
        end = time.monotonic() + 10
        while one.stats.active and time.monotonic() < end:  # its slot is given back
            time.sleep(0.05)
        return [first, second, exchange(FWD_IN, 3134, b"third\n")]

    topo.fwd_loop.run(one.start())
    try:
        first, second, third = topo.sandbox(scenario)
        assert first == b"proxy saw dev-alice-1/proxy: first\n"
        assert second == b"" or _errno(second) == errno.ECONNRESET
        assert third == b"proxy saw dev-alice-1/proxy: third\n"
        assert one.stats.refused == {"too_many_connections": 1}
    finally:
        topo.fwd_loop.run(one.close())


def _client_hello(name: str) -> bytes:
    import ssl

    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname=name)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_transparent_ports_send_nothing_before_attestation_and_connect_by_name(
    topo: Topology, pki: SimulatedPki, sec_measurement: Measurement
) -> None:
    """Transparent :443 reads the ClientHello but sends the Security CVM only the identity header
    and `CONNECT sni:443`, replaying the ClientHello only after the proxy's 200 (this stand-in
    answers something else, so it never sees it); a Security CVM that fails attestation gets
    nothing at all."""
    hello = _client_hello("pypi.org")
    good = make_forwarder(_verifier(pki, sec_measurement), proxy_port=3132)
    good.transparent_https, good.transparent_http = 4443, 8080
    other = measure(security_definition(tunnel_port=9443))
    bad = make_forwarder(_verifier(pki, other), proxy_port=3133)
    bad.transparent_https, bad.transparent_http = 4444, 8081
    for fwd in (good, bad):
        topo.fwd_loop.run(fwd.start())
    try:
        reply = topo.sandbox(lambda: exchange(FWD_IN, 4443, hello))
        assert reply == b"" or _errno(reply) in (errno.ECONNRESET, errno.EPIPE)
        assert [h.mode for h in topo.sec.headers] == ["proxy"]
        assert topo.sec.payloads == [b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n"]
        assert good.stats.refused == {"transparent_proxy_refused": 1}
        plain = b"GET /x HTTP/1.1\r\nHost: deb.debian.org\r\n\r\n"
        for port, data in ((4444, hello), (8081, plain)):
            reply = topo.sandbox(lambda p=port, d=data: exchange(FWD_IN, p, d))  # type: ignore[misc]
            assert reply == b"" or _errno(reply) in (errno.ECONNRESET, errno.EPIPE)
        assert bad.stats.refused == {"attestation_failed": 2}
        assert len(topo.sec.headers) == 1 and len(topo.sec.payloads) == 1
    finally:
        for fwd in (good, bad):
            topo.fwd_loop.run(fwd.close())


def test_the_security_endpoint_is_the_launch_agents_address_else_the_configured_host(
    tmp_path: Path,
) -> None:
    from umbra.sandbox.forwarder_config import ForwarderConfig, ForwarderConfigError
    from umbra.sandbox.forwarder_setup import security_endpoint

    d = dev_definition(security_cvm={"host": "security-cvm.umbra.internal", "port": 8443})
    doc = json.loads(render_dev_host(d.host).text)["forwarder"]
    doc["security_cvm_ips_file"] = str(tmp_path / "security-cvm-ips")
    cfg = ForwarderConfig.model_validate(doc)
    # No addresses in launch data (no file): the configured host, which must still attest.
    assert security_endpoint(cfg).host == "security-cvm.umbra.internal"
    (tmp_path / "security-cvm-ips").write_text("10.20.1.10 10.20.1.11\n")
    assert (security_endpoint(cfg).host, security_endpoint(cfg).port) == ("10.20.1.10", 8443)
    (tmp_path / "security-cvm-ips").write_text("security-cvm.evil.example\n")
    with pytest.raises(ForwarderConfigError, match="is not an IPv4 address"):
        security_endpoint(cfg)
