"""The Security CVM's tunnel endpoint, end to end with real components:

    sandbox client ─▶ real Forwarder (in-process) ─aTLS─▶ `umbra proxy serve --tunnel-listen`
    (simulated TEE quotes) ─▶ the real proxy (same process) ─▶ loopback origins

Every request must be attributed to the CVM whose authenticated tunnel carried it, and every
refused session must leave no byte at the origin.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tests.proxy.proxy_thread import ProxyThread
from umbra.attest.atls import atls_connect
from umbra.attest.collateral import StaticCollateral
from umbra.attest.eventlog import dump_dstack_event_log
from umbra.attest.measurement import MeasurementPolicy, ReleaseManifest
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verifier
from umbra.proxy.config import ProxyConfig
from umbra.proxy.identity import CvmIdentity
from umbra.proxy.startup import StartupError
from umbra.sandbox.forwarder import Forwarder
from umbra.sandbox.models import Endpoint, Tunnel
from umbra.sandbox.sandbox_ca import CaBundle

from .conftest import Env
from .harness import (
    ALICE_SECRET,
    ALICE_TOKEN,
    ALL_SECRETS,
    BOB_TOKEN,
    ProxyProcess,
    TrafficLog,
    auth_header,
    free_port,
    read_response,
    start_proxy,
    status_of,
)

COMPOSE_EVENT = ("compose-hash", bytes.fromhex("ab" * 32))


class Loop:
    """An asyncio loop on a background thread: the forwarders run here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run[T](self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, forwarders: list[Forwarder]) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for fwd in forwarders:
                await fwd.close()

        self.run(cancel_all(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@dataclass
class Tun:
    env: Env
    proxy: ProxyProcess
    tunnel_port: int
    verifier: Verifier
    loop: Loop
    workdir: Path
    forwarders: list[Forwarder] = field(default_factory=list)

    def forwarder(
        self, cvm_id: str, credential: str | None, tunnels: list[Tunnel] | None = None
    ) -> list[int]:
        fwd = Forwarder(
            cvm_id=cvm_id,
            security_cvm=Endpoint(host="127.0.0.1", port=self.tunnel_port),
            verifier=self.verifier,
            listen_host="127.0.0.1",
            proxy_port=free_port(),
            tunnels=tunnels or [],
            credential=credential,
            connect_timeout=5,
            handshake_timeout=20,
        )
        self.loop.run(fwd.start())
        self.forwarders.append(fwd)
        return fwd.ports()


@pytest.fixture(scope="module")
def tun(env: Env, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tun]:
    workdir = tmp_path_factory.mktemp("tunnel")
    pki = SimulatedPki.generate()
    pki.save(workdir / "pki")
    # The same runtime events the subprocess extends into its simulated TD: the golden values.
    tdx = SimulatedTdx(pki, image="umbra-security-cvm")
    tdx.extend_runtime_event(*COMPOSE_EVENT)
    (workdir / "event_log.json").write_text(dump_dstack_event_log(tdx.event_log()))
    release = tdx.release_manifest(
        events=[{"name": COMPOSE_EVENT[0], "payloads": [COMPOSE_EVENT[1].hex()]}]
    )
    verifier = Verifier(
        MeasurementPolicy(release=release),
        StaticCollateral(pki.collateral(int(time.time()) - 60)),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    tunnel_port = free_port()
    proxy = start_proxy(
        [
            "--policy-dir",
            str(env.policy_dir),
            "--identities",
            str(env.identities),
            "--secrets",
            str(env.secrets),
            "--upstream-ca",
            str(env.ca.cert_path),
            "--test-allow-upstream",
            "127.0.0.1/32",
            "--test-resolver",
            str(env.resolver),
            "--tunnel-listen",
            f"127.0.0.1:{tunnel_port}",
            "--quote-source",
            "simulated",
            "--simulated-pki",
            str(workdir / "pki"),
            "--event-log",
            str(workdir / "event_log.json"),
            "--tunnel-header-timeout",
            "2",
        ],
        workdir,
    )
    loop = Loop()
    tun = Tun(env, proxy, tunnel_port, verifier, loop, workdir)
    yield tun
    loop.stop(tun.forwarders)
    output = proxy.stop()
    spool_bytes = b"".join(p.read_bytes() for p in (workdir / "spool").glob("*.jsonl"))
    assert "umbra tunnel endpoint listening" in output
    # Neither secret values nor the tunnel credentials appear in the output or traffic log.
    for secret in (*ALL_SECRETS, ALICE_TOKEN, BOB_TOKEN, "tunnel-wrong-credential"):
        assert secret not in output, "a secret appeared in the proxy's output"
        assert secret.encode() not in spool_bytes, "a secret appeared in the traffic log"


@pytest.fixture(scope="module")
def alice(tun: Tun) -> list[int]:
    """cvm-alice's forwarder: proxy port, then a raw tunnel to the TCP echo origin."""
    raw = Tunnel(name="raw", listen_port=free_port(), host="tcp.test", port=tun.env.tcp.port)
    return tun.forwarder("cvm-alice", ALICE_TOKEN, [raw])


def https_via(
    tun: Tun,
    port: int,
    path: str,
    auth: str | None = None,
    host: str = "api.test",
    ca: Path | None = None,
) -> bytes:
    """CONNECT through a forwarder as the sandbox would (no proxy credentials), then GET."""
    target = f"{host}:{tun.env.origin.port}"
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
    if auth:
        head += f"Proxy-Authorization: {auth}\r\n"
    sock.sendall((head + "\r\n").encode())
    response = read_response(sock, timeout=20)
    if status_of(response) != 200:
        sock.close()
        return response
    context = ssl.create_default_context(cafile=str(ca or tun.proxy.ca))
    with context.wrap_socket(sock, server_hostname=host) as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n".encode())
        return read_response(tls, timeout=20)


def plain_via(port: int, tun: Tun, needle: str, auth: str | None = None) -> bytes:
    """An absolute-form plain HTTP request through a forwarder: the reply, or b'' if closed."""
    target = f"plain.test:{tun.env.plain.port}"
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    extra = f"Proxy-Authorization: {auth}\r\n" if auth else ""
    request = f"GET http://{target}/{needle} HTTP/1.1\r\nHost: {target}\r\n{extra}\r\n"
    with sock:
        try:
            sock.sendall(request.encode())
        except OSError:
            return b""
        return read_response(sock, timeout=20)


def test_allowed_request_is_attributed_to_the_tunnel_cvm(tun: Tun, alice: list[int]) -> None:
    mark = tun.proxy.log.mark()
    needle = f"tunnel-ok-{uuid.uuid4().hex}"
    response = https_via(tun, alice[0], f"/{needle}")
    assert status_of(response) == 200, response[:300]
    assert tun.env.recorder.contains(needle.encode())
    record = tun.proxy.log.wait_for(
        mark, lambda r: r["kind"] == "http" and r.get("path") == f"/{needle}"
    )
    assert (record["cvm_id"], record["owner"], record["team"]) == ("cvm-alice", "alice", "acme")
    assert record["decision"] == "allow"


def test_another_cvms_credential_never_changes_attribution(tun: Tun, alice: list[int]) -> None:
    mark = tun.proxy.log.mark()
    needle = f"tunnel-bob-{uuid.uuid4().hex}"
    bob = auth_header("cvm-bob", BOB_TOKEN)
    assert status_of(https_via(tun, alice[0], f"/{needle}", auth=bob)) == 407
    assert status_of(plain_via(alice[0], tun, needle, auth=bob)) == 407
    assert not tun.env.recorder.contains(needle.encode())
    deadline = time.monotonic() + 5  # records are committed in writer batches
    while True:
        new = tun.proxy.log.settled()[mark:]
        conflicts = [r for r in new if r["reason"] == "identity_conflict"]
        if len(conflicts) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(conflicts) == 2
    assert all(r["cvm_id"] == "cvm-alice" for r in conflicts)
    assert not [r for r in new if r["cvm_id"] == "cvm-bob"]


@pytest.mark.parametrize(
    ("cvm_id", "credential", "reason"),
    [
        ("cvm-mallory", "tunnel-wrong-credential", "tunnel_unknown_cvm"),
        ("cvm-alice", "tunnel-wrong-credential", "tunnel_bad_credential"),
        ("cvm-alice", BOB_TOKEN, "tunnel_bad_credential"),
        ("cvm-alice", None, "tunnel_missing_credential"),
    ],
)
def test_unauthenticated_forwarders_are_refused(
    tun: Tun, cvm_id: str, credential: str | None, reason: str
) -> None:
    port = tun.forwarder(cvm_id, credential)[0]
    mark = tun.proxy.log.mark()
    needle = f"tunnel-refused-{uuid.uuid4().hex}"
    assert plain_via(port, tun, needle) == b""
    record = tun.proxy.log.wait_for(mark, lambda r: r["reason"] == reason)
    assert record["kind"] == "connection" and record["decision"] == "deny"
    assert record["cvm_id"] is None
    assert not tun.env.recorder.contains(needle.encode())


def test_a_claimed_cvm_id_is_redacted_like_any_sandbox_text(tun: Tun) -> None:
    """A refusal's record is built by the traffic log, so a secret claimed as the cvm_id is
    redacted (fails on the endpoint that built its own records, unredacted)."""
    port = tun.forwarder(ALICE_SECRET, "tunnel-wrong-credential")[0]
    mark = tun.proxy.log.mark()
    assert plain_via(port, tun, f"tunnel-refused-{uuid.uuid4().hex}") == b""
    record = tun.proxy.log.wait_for(mark, lambda r: r["reason"] == "tunnel_unknown_cvm")
    assert ALICE_SECRET not in str(record)
    assert record["detail"] == "claimed cvm_id [redacted]"


def _raw_atls(tun: Tun, payload: bytes) -> bytes:
    async def go() -> bytes:
        conn = await atls_connect("127.0.0.1", tun.tunnel_port, tun.verifier)
        try:
            await conn.send(payload)
            try:
                return await asyncio.wait_for(conn.recv(), 15)
            except Exception:
                return b""
        finally:
            await conn.close()

    return tun.loop.run(go())


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (struct.pack(">I", 9) + b"not json!", "tunnel_malformed_header"),
        (
            struct.pack(">I", 40) + b'{"v":1,"cvm_id":"cvm-alice","mode":"x"}'.ljust(40),
            "tunnel_malformed_header",
        ),
        (struct.pack(">I", 1 << 20) + b"x" * 64, "tunnel_header_too_large"),
        (b"\x00\x00", "tunnel_header_timeout"),
    ],
)
def test_bad_headers_are_refused(tun: Tun, payload: bytes, reason: str) -> None:
    mark = tun.proxy.log.mark()
    assert _raw_atls(tun, payload) == b""
    tun.proxy.log.wait_for(mark, lambda r: r["reason"] == reason, timeout=10)


def test_a_client_that_skips_atls_is_refused(tun: Tun) -> None:
    mark = tun.proxy.log.mark()
    needle = f"tunnel-noatls-{uuid.uuid4().hex}"
    target = f"plain.test:{tun.env.plain.port}"
    with socket.create_connection(("127.0.0.1", tun.tunnel_port), timeout=20) as sock:
        sock.sendall(f"GET http://{target}/{needle} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        reply = read_response(sock, timeout=20)
    assert b"HTTP/" not in reply
    tun.proxy.log.wait_for(mark, lambda r: r["reason"] == "tunnel_atls_failed", timeout=10)
    assert not tun.env.recorder.contains(needle.encode())


def _tcp_round_trip(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(data)
        got = b""
        deadline = time.monotonic() + 15
        while data not in got and time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
        return got


def test_tunnel_rule_relays_raw_tcp(tun: Tun, alice: list[int]) -> None:
    mark = tun.proxy.log.mark()
    needle = f"raw-{uuid.uuid4().hex}\n".encode()
    got = _tcp_round_trip(alice[1], needle)
    assert got.startswith(b"HELLO-TCP\n") and needle in got
    record = tun.proxy.log.wait_for(mark, lambda r: r["kind"] == "tunnel")
    assert record["cvm_id"] == "cvm-alice" and record["decision"] == "allow"
    assert record["rule_id"] == "testing:raw"


def test_no_tunnel_rule_no_raw_tcp(tun: Tun) -> None:
    """cvm-nothing has no profiles: its forwarder's tunnel must not reach the echo origin."""
    raw = Tunnel(name="raw", listen_port=free_port(), host="tcp.test", port=tun.env.tcp.port)
    ports = tun.forwarder("cvm-nothing", "carol-credential", [raw])
    before = tun.env.tcp.connections
    needle = f"raw-nothing-{uuid.uuid4().hex}\r\n\r\n".encode()
    got = _tcp_round_trip(ports[1], needle)
    assert b"HELLO-TCP" not in got and needle not in got
    assert tun.env.tcp.connections == before
    with tun.env.recorder.lock:
        assert not any(needle in chunk for chunk in tun.env.recorder.raw_tcp)


def test_tunnel_identities_do_not_outlive_their_connection(tun: Tun, alice: list[int]) -> None:
    """A second, non-tunnel client from loopback with no credentials is unknown (407)."""
    with socket.create_connection(("127.0.0.1", tun.proxy.port), timeout=10) as sock:
        target = f"api.test:{tun.env.origin.port}"
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        assert status_of(read_response(sock)) == 407


def _inprocess_config(tun: Tun, spool: Path, **overrides: Any) -> ProxyConfig:
    values: dict[str, Any] = {
        "listen_host": "127.0.0.1",
        "listen_port": 0,
        "policy_dir": tun.env.policy_dir,
        "identities": tun.env.identities,
        "secrets": tun.env.secrets,
        "traffic_log": spool / "spool",
        "confdir": spool / "ca",
        "upstream_ca": tun.env.ca.cert_path,
        "test_allow_upstream": ["127.0.0.1/32"],
        "test_resolver": tun.env.resolver,
        "tunnel_listen_host": "127.0.0.1",
        "tunnel_listen_port": 0,
        "quote_source": "simulated",
        "simulated_pki": tun.workdir / "pki",
        "event_log": tun.workdir / "event_log.json",
    }
    return ProxyConfig(**(values | overrides))


def test_in_process_registry_entries_end_with_their_connection(tun: Tun, tmp_path: Path) -> None:
    runner = ProxyThread(_inprocess_config(tun, tmp_path))
    runner.start()
    try:
        registry = runner.proxy.tunnel_identities
        assert runner.proxy.tunnel_port is not None
        fwd = Forwarder(
            cvm_id="cvm-bob",
            security_cvm=Endpoint(host="127.0.0.1", port=runner.proxy.tunnel_port),
            verifier=tun.verifier,
            listen_host="127.0.0.1",
            proxy_port=free_port(),
            credential=BOB_TOKEN,
        )
        tun.loop.run(fwd.start())
        tun.forwarders.append(fwd)
        needle = f"inproc-tunnel-{uuid.uuid4().hex}"
        seen: list[int] = []
        real_register = registry.register

        def register(host: str, port: int, identity: CvmIdentity) -> None:
            seen.append(port)
            real_register(host, port, identity)

        registry.register = register  # type: ignore[method-assign]
        response = https_via(
            tun,
            fwd.ports()[0],
            f"/{needle}",
            host="other.test",
            ca=tmp_path / "ca" / "mitmproxy-ca-cert.pem",
        )
        assert status_of(response) == 200, response[:300]
        assert len(seen) == 1  # one sandbox connection, one registered source
        deadline = time.monotonic() + 10
        while len(registry) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(registry) == 0
        record = [r for r in _records(tmp_path / "spool") if r.get("path") == f"/{needle}"]
        assert [(r["cvm_id"], r["owner"]) for r in record] == [("cvm-bob", "bob")]
    finally:
        runner.stop()


def _records(spool: Path) -> list[dict[str, Any]]:
    log = TrafficLog(spool)
    log.wait_for(0, lambda r: r["kind"] == "http")
    return log.records()


def test_tunnel_endpoint_start_up_fails_closed(tun: Tun, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="loopback"):
        _inprocess_config(tun, tmp_path, listen_host="0.0.0.0")  # noqa: S104
    runner = ProxyThread(_inprocess_config(tun, tmp_path, simulated_pki=tmp_path / "missing"))
    with pytest.raises(StartupError, match="simulated PKI"):
        runner.start()


# ------------------------------------------------------------------ the sandbox's CA


def _ca_forwarder(tun: Tun, cvm_id: str, credential: str | None, verifier: Verifier) -> Forwarder:
    return Forwarder(
        cvm_id=cvm_id,
        security_cvm=Endpoint(host="127.0.0.1", port=tun.tunnel_port),
        verifier=verifier,
        listen_host="127.0.0.1",
        proxy_port=free_port(),
        credential=credential,
        connect_timeout=5,
        handshake_timeout=20,
    )


def test_the_sandbox_ca_comes_from_the_attested_security_cvm(
    tun: Tun, alice: list[int], tmp_path: Path
) -> None:
    """The forwarder's `ca` request, inside aTLS to the real endpoint: exactly the proxy's
    interception CA, which then verifies HTTPS through the forwarder (no other trust given)."""
    fwd = _ca_forwarder(tun, "cvm-alice", ALICE_TOKEN, tun.verifier)
    pem = tun.loop.run(fwd.fetch_ca())
    assert pem == tun.proxy.ca.read_bytes()
    bundle = CaBundle(tmp_path / "sandbox-ca.pem")
    assert bundle.add(pem)
    written = bundle.path.read_bytes()
    assert b"PRIVATE KEY" not in written and (bundle.path.stat().st_mode & 0o777) == 0o644
    needle = f"tunnel-ca-{uuid.uuid4().hex}"
    response = https_via(tun, alice[0], f"/{needle}", ca=bundle.path)
    assert status_of(response) == 200, response[:300]
    assert not bundle.add(pem)  # the same CA again: unchanged


def test_no_ca_without_attestation_or_credential(tun: Tun, tmp_path: Path) -> None:
    """A Security CVM that does not verify (another release) gives nothing, and the endpoint
    gives its CA only to a known CVM with its credential."""
    release = tun.verifier.policy.release.model_dump(mode="json", exclude_none=True)
    other = release | {"events": [{"name": "compose-hash", "payloads": ["cd" * 32]}]}
    pki = SimulatedPki.load(tun.workdir / "pki")
    wrong = Verifier(
        MeasurementPolicy(release=ReleaseManifest.model_validate(other)),
        StaticCollateral(pki.collateral(int(time.time()) - 60)),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    unverified = _ca_forwarder(tun, "cvm-alice", ALICE_TOKEN, wrong)
    assert tun.loop.run(unverified.fetch_ca()) is None
    assert unverified.stats.refused == {"attestation_failed": 1}
    mark = tun.proxy.log.mark()
    stranger = _ca_forwarder(tun, "cvm-alice", "tunnel-wrong-credential", tun.verifier)
    assert tun.loop.run(stranger.fetch_ca()) is None
    assert stranger.stats.refused == {"ca_unavailable": 1}
    tun.proxy.log.wait_for(mark, lambda r: r.get("reason") == "tunnel_bad_credential")
