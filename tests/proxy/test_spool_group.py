"""The traffic spool's group commit: records that arrive together share one write and one fsync,
`flush` does not wait out the interval, and a clean shutdown writes every queued record (also of a
real proxy stopped by SIGTERM right after its last answer)."""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path

import pytest

from tests.proxy.harness import (
    OriginServer,
    Recorder,
    TestCA,
    auth_header,
    read_response,
    start_proxy,
    status_of,
    write_identities,
    write_secrets,
)
from tests.proxy.spool_records import read_records
from umbra.contracts.traffic import TrafficRecord
from umbra.proxy.spool import Spool


def _record(index: int) -> TrafficRecord:
    return TrafficRecord.build(decision="deny", reason=f"r{index}")


def test_records_arriving_together_share_one_fsync(tmp_path: Path) -> None:
    spool = Spool(tmp_path, flush_interval=0.3)
    try:
        for index in range(200):
            spool.append(_record(index))
        time.sleep(0.8)  # the group's interval has passed: on disk without a flush
        assert [r["reason"] for r in read_records(tmp_path)] == [f"r{i}" for i in range(200)]
        assert spool.commits == 1, "one group, one write and fsync (not one per record)"
    finally:
        spool.close()


def test_flush_cuts_the_interval_short(tmp_path: Path) -> None:
    spool = Spool(tmp_path, flush_interval=30)
    try:
        spool.append(_record(0))
        started = time.monotonic()
        spool.flush()
        assert time.monotonic() - started < 5
        assert [r["reason"] for r in read_records(tmp_path)] == ["r0"]
    finally:
        spool.close()


def test_close_writes_every_queued_record(tmp_path: Path) -> None:
    spool = Spool(tmp_path, flush_interval=30)  # nothing would be written for 30 s
    for index in range(50):
        spool.append(_record(index))
    started = time.monotonic()
    spool.close()
    assert time.monotonic() - started < 5, "close does not wait out the interval"
    assert [r["reason"] for r in read_records(tmp_path)] == [f"r{i}" for i in range(50)]
    with pytest.raises(RuntimeError, match="closed"):
        spool.append(_record(99))  # nothing is accepted (and silently lost) after close


def test_a_proxy_stopped_right_after_answering_has_logged_every_request(tmp_path: Path) -> None:
    ca = TestCA(tmp_path)
    cert, key = ca.issue(["spool.test"])
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    origin = OriginServer(Recorder(), tls).start()
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "p.yaml").write_text(
        "apiVersion: umbra/v1\nkind: Profile\nname: testing\negress:\n"
        f"  - allow: {{hosts: [127.0.0.1], ports: [{origin.port}]}}\n"
    )
    identities, secrets = tmp_path / "identities.json", tmp_path / "secrets.json"
    write_identities(identities)
    write_secrets(secrets)
    proxy = start_proxy(
        ["--policy-dir", str(policies), "--identities", str(identities),
         "--secrets", str(secrets), "--upstream-ca", str(ca.cert_path),
         "--test-allow-upstream", "127.0.0.1/32"],
        tmp_path,
    )  # fmt: skip
    try:
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
        target = f"127.0.0.1:{origin.port}"
        sock.sendall(
            f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
            f"Proxy-Authorization: {auth_header()}\r\n\r\n".encode()
        )
        assert status_of(read_response(sock)) == 200
        client = ssl.create_default_context(cafile=str(proxy.ca))
        client.check_hostname = False
        tunnel = client.wrap_socket(sock, server_hostname="127.0.0.1")
        for index in range(40):
            tunnel.sendall(f"GET /n{index} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            assert status_of(read_response(tunnel)) == 200
        # The last records are still in their group (50 ms) when the proxy is told to stop.
        proxy.process.terminate()
        proxy.process.wait(timeout=20)
        tunnel.close()
    finally:
        if proxy.process.poll() is None:
            proxy.process.kill()
        origin.shutdown()
    paths = [r["path"] for r in read_records(tmp_path / "spool") if r.get("kind") == "http"]
    assert paths == [f"/n{index}" for index in range(40)]
