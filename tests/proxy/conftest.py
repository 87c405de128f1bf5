"""One real proxy (`umbra proxy serve`, a subprocess) in front of real loopback origin servers,
shared by the proxy tests of a session."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.proxy.harness import (
    ALL_SECRETS,
    ORIGIN_NAMES,
    KeepAliveOrigin,
    OriginServer,
    ProxyProcess,
    Recorder,
    TcpEcho,
    TestCA,
    WsOrigin,
    free_port,
    start_proxy,
    write_identities,
    write_secrets,
)


@dataclass
class Env:
    workdir: Path
    ca: TestCA
    recorder: Recorder
    origin: OriginServer
    plain: OriginServer
    tcp: TcpEcho
    ws: WsOrigin
    proxy: ProxyProcess
    policy_dir: Path
    identities: Path
    secrets: Path
    resolver: Path
    keepalive: KeepAliveOrigin


def policy_yaml(
    tls_port: int, plain_port: int, tcp_port: int, ws_port: int, self_port: int, keepalive_port: int
) -> str:
    return f"""
apiVersion: umbra/v1
kind: Profile
name: testing
egress:
  - id: api
    allow: {{hosts: [api.test, other.test, ai.test, git.test, pypi.test], ports: [{tls_port}]}}
  - id: faults
    allow: {{hosts: [fault-request.test, fault-requestheaders.test, fault-response.test, fault-responseheaders.test, fault-server_connect.test, fault-resolver.test], ports: [{tls_port}]}}
  - id: admin
    deny: {{hosts: [api.test], ports: [{tls_port}], paths: ["/admin/**"]}}
  - id: ro
    allow: {{hosts: [ro.test], ports: [{tls_port}], methods: [GET, HEAD]}}
  - id: plain
    allow: {{hosts: [plain.test], schemes: [http, https], ports: [{plain_port}]}}
  - id: nets
    allow: {{hosts: [rebind.test, private.test, metadata.test, cgnat.test, ula.test, loop2.test, "127.0.0.1", "::ffff:127.0.0.1", "64:ff9b::7f00:1"], ports: [{tls_port}]}}
  - id: self
    allow: {{hosts: [self.test], schemes: [http], ports: [{self_port}]}}
  - id: ws
    allow: {{hosts: [ws.test], ports: [{ws_port}, {keepalive_port}]}}
  - id: raw
    tunnel: {{hosts: [tcp.test], ports: [{tcp_port}]}}
sandbox_env:
  CLAUDE_CODE_OAUTH_TOKEN: "umbra-placeholder:personal/openai"
  TESTING_GREETING: "it's a test"
scan:
  - {{id: acme-token, regex: 'acme_[A-Za-z0-9]{{32}}'}}
inject:
  - {{id: api-bearer, header: Authorization, format: "Bearer {{secret}}", secret: team/github-bot, hosts: [api.test], ports: [{tls_port}]}}
  - {{id: git-basic, header: Authorization, format: "Basic {{basic:x-access-token}}", secret: team/github-bot, hosts: [git.test], ports: [{tls_port}]}}
  - {{id: pypi-basic, header: Authorization, format: "Basic {{basic:pip}}", secret: team/pypi, hosts: [pypi.test], ports: [{tls_port}]}}
  - {{id: openai, header: X-Api-Key, format: "{{secret}}", secret: personal/openai, hosts: [ai.test], ports: [{tls_port}]}}
  - {{id: fault-inject, header: X-Fault, format: "{{secret}}", secret: team/github-bot, hosts: [fault-response.test], ports: [{tls_port}]}}
  - {{id: plain-inject, header: X-Plain-Key, format: "{{secret}}", secret: team/github-bot, hosts: [plain.test], ports: [{plain_port}]}}
"""


@pytest.fixture(scope="session")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    workdir = tmp_path_factory.mktemp("proxy")
    ca = TestCA(workdir)
    cert, key = ca.issue([*ORIGIN_NAMES, "tcp.test"])
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    recorder = Recorder()
    origin = OriginServer(recorder, tls).start()
    plain = OriginServer(recorder, None).start()
    tcp = TcpEcho(recorder)
    ws = WsOrigin(recorder, tls)
    keepalive = KeepAliveOrigin(tls)
    proxy_port = free_port()
    policy_dir = workdir / "policies"
    policy_dir.mkdir()
    (policy_dir / "testing.yaml").write_text(
        policy_yaml(origin.port, plain.port, tcp.port, ws.port, proxy_port, keepalive.port)
    )
    resolver = workdir / "resolver.json"
    answers: dict[str, object] = {
        name: ["127.0.0.1"]
        for name in [
            "api.test",
            "other.test",
            "evil.test",
            "ro.test",
            "ai.test",
            "git.test",
            "pypi.test",
            "ws.test",
            "plain.test",
            "tcp.test",
            "self.test",
            "fault-request.test",
            "fault-requestheaders.test",
            "fault-response.test",
            "fault-responseheaders.test",
            "fault-server_connect.test",
            "xn--pi-6kc.test",
        ]
    }
    answers |= {
        "rebind.test": [["127.0.0.1"], ["10.0.0.7"]],
        "private.test": ["10.1.2.3"],
        "metadata.test": ["169.254.169.254"],
        "cgnat.test": ["100.64.0.9"],
        "ula.test": ["fd00::5"],
        "loop2.test": ["127.0.0.1", "127.0.0.2"],
        "fault-resolver.test": "fail",
    }
    resolver.write_text(json.dumps(answers))
    identities = workdir / "identities.json"
    write_identities(identities)
    secrets = workdir / "secrets.json"
    write_secrets(secrets)
    proxy = start_proxy(
        [
            "--policy-dir",
            str(policy_dir),
            "--identities",
            str(identities),
            "--secrets",
            str(secrets),
            "--upstream-ca",
            str(ca.cert_path),
            "--test-allow-upstream",
            "127.0.0.1/32",
            "--test-resolver",
            str(resolver),
            "--max-body",
            str(1 << 20),
        ],
        workdir,
        port=proxy_port,
    )
    environment = Env(
        workdir,
        ca,
        recorder,
        origin,
        plain,
        tcp,
        ws,
        proxy,
        policy_dir,
        identities,
        secrets,
        resolver,
        keepalive,
    )
    yield environment
    output = proxy.stop()
    origin.shutdown()
    plain.shutdown()
    keepalive.shutdown()
    # Secrets never appear in anything the proxy wrote: its output and its traffic log.
    spool_bytes = b"".join(p.read_bytes() for p in (workdir / "spool").glob("*.jsonl"))
    for secret in ALL_SECRETS:
        assert secret not in output, "a secret value appeared in the proxy's output"
        assert secret.encode() not in spool_bytes, "a secret value appeared in the traffic log"
