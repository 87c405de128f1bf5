"""Tools that ignore proxy variables, end to end: real curl/openssl/getent in a sandbox namespace
whose resolver is the forwarder, the real `umbra forwarder serve` (DNS + transparent listeners)
behind the local CVM's nftables filter, the real `umbra proxy serve` with its aTLS tunnel endpoint
on a simulated TEE, and origins on :443 and :80 in the Security namespace.

    sandbox ns 10.200.1.2 ── 10.200.1.1 forwarder ns 10.200.2.1 ── 10.200.2.2 security ns
    resolv.conf: nameserver 10.200.1.1    (nft: tcp 3128/443/80/53, udp 53)   proxy + origins

No proxy variable is set anywhere in the sandbox: names resolve to the forwarder, which takes the
destination from the SNI / Host and hands it to the proxy as a CONNECT, so the policy, the name
checks and the traffic records are the proxy's own.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.proxy.harness import TestCA as OriginCA
from tests.proxy.harness import TrafficLog
from umbra.attest.eventlog import dump_dstack_event_log
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.proxy.identity import hash_credential
from umbra.sandbox.local_cvm import forwarder_filter

from .netns import namespaces, require_netns, run_in, veth

SBX, FWD_IN, FWD_OUT, SEC = "10.200.1.2", "10.200.1.1", "10.200.2.1", "10.200.2.2"
CVM, CREDENTIAL = "cvm-transparent", "transparent-credential-0123456789"
UMBRA = Path(sys.executable).parent / "umbra"
NAMES = ["allowed.test", "denied.test", "plain.test", "plain-denied.test"]
POLICY = """apiVersion: umbra/v1
kind: Profile
name: transparent
egress:
  - id: tls
    allow: {hosts: [allowed.test], ports: [443]}
  - id: http
    allow: {hosts: [plain.test], schemes: [http], ports: [80]}
"""


class Origin(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = f"origin saw {self.headers.get('Host')} {self.path}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Env:
    ns: dict[str, str]
    workdir: Path
    log: TrafficLog
    mitm_ca: Path
    forwarder_log: Path

    def sandbox(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a real tool in the sandbox namespace with the forwarder as its only resolver, in a
        clean environment (no proxy variables)."""
        script = (
            'mount --bind "$1" /etc/resolv.conf && mount --bind "$2" /etc/hosts && shift 2 && '
            'exec "$@"'
        )
        return subprocess.run(
            [
                "ip", "netns", "exec", self.ns["sandbox"], "unshare", "-m", "--propagation",
                "private", "sh", "-c", script, "sh", str(self.workdir / "resolv.conf"),
                str(self.workdir / "hosts"), *argv,
            ],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8", "HOME": "/tmp"},
        )  # fmt: skip

    def curl(self, url: str, *args: str) -> subprocess.CompletedProcess[str]:
        return self.sandbox(
            "curl", "-sS", "--max-time", "30", "--cacert", str(self.mitm_ca),
            "-w", "\n%{http_code}", *args, url,
        )  # fmt: skip


def _serve(ns: str, port: int, tls: ssl.SSLContext | None) -> ThreadingHTTPServer:
    def make() -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", port), Origin)
        server.daemon_threads = True
        if tls is not None:
            server.socket = tls.wrap_socket(server.socket, server_side=True)
        return server

    server = run_in(ns, make)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], what: str) -> None:
    end = time.monotonic() + 90
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None, f"{what} exited: {path.read_text(errors='replace')}"
        assert time.monotonic() < end, f"{what} did not start: {path.read_text(errors='replace')}"
        time.sleep(0.1)


def _listening(ns: str, port: int) -> bool:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "ss", "-Hltn", f"sport = :{port}"],
        capture_output=True, text=True, timeout=10,
    ).stdout  # fmt: skip
    return bool(out.strip())


def _write_config(work: Path, ca: OriginCA) -> None:
    (work / "resolv.conf").write_text(f"nameserver {FWD_IN}\noptions timeout:2 attempts:1\n")
    (work / "hosts").write_text("127.0.0.1 localhost\n")
    (work / "policies" / "profiles").mkdir(parents=True)
    (work / "policies" / "profiles" / "transparent.yaml").write_text(POLICY)
    cvm = {
        "cvm_id": CVM,
        "owner": "tess",
        "team": "acme",
        "profiles": ["transparent"],
        "credential_sha256": hash_credential(CREDENTIAL),
    }
    (work / "identities.json").write_text(json.dumps({"cvms": [cvm]}))
    (work / "resolver.json").write_text(json.dumps({n: ["127.0.0.1"] for n in NAMES}))
    pki = SimulatedPki.generate()
    pki.save(work / "pki")
    tdx = SimulatedTdx(pki, image="umbra-security-cvm")
    (work / "event_log.json").write_text(dump_dstack_event_log(tdx.event_log()))
    release = tdx.release_manifest().model_dump(mode="json", exclude_none=True)
    (work / "collateral.json").write_text(pki.collateral(int(time.time()) - 60).json_text)
    (work / "root.der").write_bytes(pki.root_der)
    (work / "cvm-id").write_text(CVM + "\n")
    (work / "credential").write_text(CREDENTIAL + "\n")
    config = {
        "apiVersion": "umbra/v1",
        "kind": "ForwarderConfig",
        "listen": {"host": FWD_IN, "proxy_port": 3128, "transparent": {}, "dns_port": 53},
        "security_cvm": {"host": SEC, "port": 8443},
        "security_cvm_release": release,
        "collateral": {"file": str(work / "collateral.json")},
        "allow_simulated": True,
        "simulated_root": str(work / "root.der"),
        "cvm_id_file": str(work / "cvm-id"),
        "credential_file": str(work / "credential"),
        "connect_timeout": 5,
        "handshake_timeout": 20,
    }
    (work / "forwarder.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_netns()
    for tool in ("curl", "openssl", "unshare", "nft", "getent", "ss"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (scripts/system-deps)")
    work = tmp_path_factory.mktemp("transparent")
    work.chmod(0o755)
    ca = OriginCA(work)
    cert, key = ca.issue(NAMES)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    _write_config(work, ca)
    procs: list[subprocess.Popen[bytes]] = []
    servers: list[ThreadingHTTPServer] = []
    with namespaces("sandbox", "fwd", "sec") as ns:
        try:
            veth(ns["sandbox"], "sb0", f"{SBX}/24", ns["fwd"], "fw0", f"{FWD_IN}/24")
            veth(ns["fwd"], "fw1", f"{FWD_OUT}/24", ns["sec"], "se0", f"{SEC}/24")
            # Exactly the local Dev CVM's filter (sandbox/local_cvm.py).
            rules = forwarder_filter("fw0", FWD_IN, [3128, 443, 80, 53], [53])
            subprocess.run(
                ["ip", "netns", "exec", ns["fwd"], "nft", "-f", "-"],
                input=rules, text=True, check=True, capture_output=True, timeout=30,
            )  # fmt: skip
            servers += [_serve(ns["sec"], 443, tls), _serve(ns["sec"], 80, None)]
            proxy_log = work / "proxy.log"
            procs.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns["sec"],
                        str(UMBRA),
                        "proxy",
                        "serve",
                        "--workers",
                        "1",
                        "--listen",
                        "127.0.0.1:8080",
                        "--tunnel-listen",
                        f"{SEC}:8443",
                        "--policy-dir",
                        str(work / "policies"),
                        "--identities",
                        str(work / "identities.json"),
                        "--confdir",
                        str(work / "mitm-ca"),
                        "--traffic-log",
                        str(work / "spool"),
                        "--upstream-ca",
                        str(ca.cert_path),
                        "--test-allow-upstream",
                        "127.0.0.1/32",
                        "--test-resolver",
                        str(work / "resolver.json"),
                        "--quote-source",
                        "simulated",
                        "--simulated-pki",
                        str(work / "pki"),
                        "--event-log",
                        str(work / "event_log.json"),
                    ],
                    stdout=proxy_log.open("wb"),
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            )
            _wait_for(proxy_log, "umbra tunnel endpoint listening", procs[-1], "proxy")
            fwd_log = work / "forwarder.log"
            procs.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns["fwd"],
                        str(UMBRA),
                        "forwarder",
                        "serve",
                        "-v",
                        "-c",
                        str(work / "forwarder.json"),
                    ],
                    stdout=fwd_log.open("wb"),
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
            end = time.monotonic() + 90
            while not all(_listening(ns["fwd"], p) for p in (3128, 443, 80, 53)):
                assert procs[-1].poll() is None, fwd_log.read_text()
                assert time.monotonic() < end, "the forwarder did not listen"
                time.sleep(0.2)
            mitm_ca = work / "mitm-ca" / "mitmproxy-ca-cert.pem"
            yield Env(ns, work, TrafficLog(work / "spool"), mitm_ca, fwd_log)
        finally:
            for proc in procs:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            for server in servers:
                server.shutdown()
                server.server_close()


def test_every_name_resolves_to_the_forwarder_only(env: Env) -> None:
    done = env.sandbox("getent", "ahostsv4", "pypi.org")
    assert done.returncode == 0, done.stderr
    assert {line.split()[0] for line in done.stdout.splitlines()} == {FWD_IN}
    # AAAA is NODATA: asked for any family, glibc gets only the IPv4 answer.
    both = env.sandbox("getent", "ahosts", "files.pythonhosted.org").stdout.splitlines()
    assert {line.split()[0] for line in both} == {FWD_IN}
    assert env.sandbox("getent", "hosts", "anything.at.all.example").stdout.split()[0] == FWD_IN


def test_https_by_name_without_proxy_variables(env: Env) -> None:
    mark = env.log.mark()
    done = env.curl("https://allowed.test/hello?x=1")
    assert done.stdout.endswith("\n200"), (done.stdout, done.stderr)
    assert "origin saw allowed.test /hello?x=1" in done.stdout
    record = env.log.wait_for(mark, lambda r: r["kind"] == "http" and r.get("path") == "/hello")
    assert (record["cvm_id"], record["decision"], record["connect_host"], record["port"]) == (
        CVM, "allow", "allowed.test", 443,
    )  # fmt: skip


def test_denied_host_is_denied_with_a_record(env: Env) -> None:
    mark = env.log.mark()
    done = env.curl("https://denied.test/secret-path")
    assert done.stdout.endswith("\n403"), (done.stdout, done.stderr)
    assert "origin saw" not in done.stdout
    record = env.log.wait_for(mark, lambda r: r.get("connect_host") == "denied.test")
    assert (record["cvm_id"], record["decision"]) == (CVM, "deny")


def test_plain_http_by_host_header(env: Env) -> None:
    mark = env.log.mark()
    done = env.curl("http://plain.test/dists/Release")
    assert done.stdout.endswith("\n200"), (done.stdout, done.stderr)
    assert "origin saw plain.test /dists/Release" in done.stdout
    env.log.wait_for(mark, lambda r: r.get("path") == "/dists/Release" and r["decision"] == "allow")
    denied = env.curl("http://plain-denied.test/x")
    assert denied.stdout.endswith("\n403"), (denied.stdout, denied.stderr)


def test_no_sni_or_an_ip_literal_is_refused_before_the_proxy(env: Env) -> None:
    mark = env.log.mark()
    hello = env.sandbox(
        "openssl", "s_client", "-connect", f"{FWD_IN}:443", "-noservername", timeout=60
    )
    assert "BEGIN CERTIFICATE" not in hello.stdout
    literal = env.curl(f"https://{FWD_IN}/", "-k")
    assert literal.stdout.endswith("\n000"), literal.stdout
    host_literal = env.curl(f"http://{FWD_IN}/")
    assert host_literal.stdout.endswith("\n000"), host_literal.stdout
    log = env.forwarder_log.read_text()
    assert "transparent_no_sni" in log and "transparent_ip_literal" in log
    time.sleep(0.5)
    assert env.log.settled()[mark:] == [], "nothing reached the proxy"


def test_udp_elsewhere_and_other_ports_go_nowhere(env: Env) -> None:
    # The filter admits UDP 53 only; TCP only the listeners. Other UDP/TCP to the forwarder and
    # anything to its uplink address are dropped (no answer, a timeout).
    probe = f"""
import socket
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.settimeout(2)
u.sendto(b"x", ("{FWD_IN}", 123))
try:
    u.recv(10)
    print("udp-answered")
except OSError:
    print("udp-silent")
for host, port in (("{FWD_IN}", 8443), ("{FWD_OUT}", 443), ("{SEC}", 8443)):
    t = socket.socket()
    t.settimeout(2)
    try:
        t.connect((host, port))
        print("tcp-open")
    except OSError:
        print("tcp-closed")
"""
    done = env.sandbox(sys.executable, "-c", probe)
    assert done.stdout.split() == ["udp-silent"] + ["tcp-closed"] * 3, done
