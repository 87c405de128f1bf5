"""Egress inspection that sees what agents actually send (issue 23): the upstream handshake,
injection bound to scheme, host and port, faults in WebSocket hooks, and credentials reflected in
pieces. One in-process proxy (`ProxyThread`, so a test can inject a failing dependency into the
real addons) in front of real loopback origins; real clients."""

from __future__ import annotations

import base64
import bz2
import concurrent.futures
import io
import json
import lzma
import os
import socket
import ssl
import subprocess
import tarfile
import threading
import time
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import wsproto
import wsproto.events

from tests.proxy.git_origin import GitOrigin
from tests.proxy.harness import (
    TEAM_SECRET,
    OriginHandler,
    OriginServer,
    Recorder,
    Seen,
    TestCA,
    TlsWsServer,
    TrafficLog,
    auth_header,
    read_response,
    status_of,
    write_identities,
    write_secrets,
)
from tests.proxy.proxy_thread import ProxyThread
from umbra.proxy.config import ProxyConfig
from umbra.proxy.decode import MAX_DEPTH

ALPN_SECRET = "alpnleak-5d1e9a7c3b"


class SplitWsOrigin(TlsWsServer):
    """A TLS WebSocket origin that echoes the request's Authorization back in pieces when asked
    (`split`: two messages; `split-b64`: the second half base64; `hello`: an `echo`), and records
    how each connection ended."""

    def __init__(self, tls: ssl.SSLContext) -> None:
        self.ended: list[str] = []
        super().__init__(tls)

    def on_event(
        self, request: wsproto.events.Request, event: wsproto.events.Event
    ) -> Iterator[wsproto.events.Event]:
        if not isinstance(event, wsproto.events.Message):
            return
        headers = dict((k.lower(), v) for k, v in request.extra_headers)
        auth = bytes(headers.get(b"authorization", b"")).decode()
        middle = len(auth) // 2
        if event.data == "split":
            parts = [auth[:middle], auth[middle:]]
        elif event.data == "split-b64":
            parts = [auth[:middle], base64.b64encode(auth[middle:].encode()).decode()]
        elif event.data == "almost":
            parts = ["say Bearer TE", "next"]
        else:
            parts = ["echo"]
        for part in parts:
            yield wsproto.events.TextMessage(data=part)
            time.sleep(0.2)

    def on_close(
        self, request: wsproto.events.Request, event: wsproto.events.CloseConnection
    ) -> None:
        self.ended.append(f"close {event.code}")

    def on_end(self, how: str) -> None:
        self.ended.append(how)


def _grpc_origin(cert: Path, key: Path) -> tuple[grpc.Server, int, list[bytes]]:
    """A real gRPC server (grpcio, TLS) whose one method echoes the request bytes it got."""
    seen: list[bytes] = []

    def say(request: bytes, context: grpc.ServicerContext) -> bytes:
        seen.append(request)
        return b"ok:" + request[:16]

    handler = grpc.method_handlers_generic_handler(
        "echo.Echo", {"Say": grpc.unary_unary_rpc_method_handler(say)}
    )
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, port, seen


class HelloRecorder:
    """A TCP listener that records the first bytes a client sends (the TLS ClientHello) and
    closes: what the origin would have learnt from the handshake."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = int(self.sock.getsockname()[1])
        self.hellos: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while len(data) < 5 or len(data) < 5 + int.from_bytes(data[3:5], "big"):
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                except OSError:
                    pass
                self.hellos.append(data)


@dataclass
class Env23:
    workdir: Path
    recorder: Recorder
    origin: OriginServer
    other: OriginServer
    hello: HelloRecorder
    git: GitOrigin
    grpc_port: int
    grpc_seen: list[bytes]
    ws: SplitWsOrigin
    runner: ProxyThread
    port: int
    log: TrafficLog

    @property
    def ca(self) -> Path:
        return self.workdir / "mitm-ca" / "mitmproxy-ca-cert.pem"


POLICY = """
apiVersion: umbra/v1
kind: Profile
name: testing
egress:
  - id: api
    allow: {{hosts: [api.test], ports: [{origin}, {other}]}}
  - id: hello
    allow: {{hosts: [hello.test], ports: [{hello}]}}
  - id: ws
    allow: {{hosts: [ws.test], ports: [{ws}]}}
  - id: grpc
    allow: {{hosts: [grpc.test], ports: [{grpc}]}}
  - id: git-read
    allow: {{hosts: [git.test], ports: [{git}], methods: [GET]}}
  - id: git-push
    allow: {{hosts: [git.test], ports: [{git}], methods: [POST], paths: ["/repo.git/git-receive-pack"]}}
    push_refs: ["refs/heads/agent/**"]
inject:
  - {{id: api-bearer, header: Authorization, format: "Bearer {{secret}}", secret: team/github-bot, hosts: [api.test], ports: [{origin}]}}
  - {{id: ws-bearer, header: Authorization, format: "Bearer {{secret}}", secret: team/github-bot, hosts: [ws.test], ports: [{ws}]}}
"""


@pytest.fixture(scope="module")
def env23(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env23]:
    workdir = tmp_path_factory.mktemp("proxy23")
    ca = TestCA(workdir)
    cert, key = ca.issue(["api.test", "ws.test", "hello.test", "git.test", "grpc.test"])
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    recorder = Recorder()
    origin = OriginServer(recorder, tls).start()
    other = OriginServer(recorder, tls).start()
    hello = HelloRecorder()
    ws = SplitWsOrigin(tls)
    (workdir / "git").mkdir()
    git = GitOrigin(workdir / "git", tls)
    git.bare("repo.git")
    grpc_server, grpc_port, grpc_seen = _grpc_origin(cert, key)
    origin.routes["api.test"] = _sse_routes
    policy_dir = workdir / "policies"
    policy_dir.mkdir()
    (policy_dir / "testing.yaml").write_text(
        POLICY.format(
            origin=origin.port,
            other=other.port,
            hello=hello.port,
            ws=ws.port,
            git=git.port,
            grpc=grpc_port,
        )
    )
    resolver = workdir / "resolver.json"
    resolver.write_text(
        json.dumps(
            {
                n: ["127.0.0.1"]
                for n in ("api.test", "ws.test", "hello.test", "git.test", "grpc.test")
            }
        )
    )
    identities = workdir / "identities.json"
    write_identities(identities)
    secrets = workdir / "secrets.json"
    write_secrets(secrets)
    config = ProxyConfig(
        listen_host="127.0.0.1",
        listen_port=0,
        policy_dir=policy_dir,
        identities=identities,
        secrets=secrets,
        traffic_log=workdir / "spool",
        confdir=workdir / "mitm-ca",
        upstream_ca=ca.cert_path,
        test_resolver=resolver,
        test_allow_upstream=["127.0.0.1/32"],
        max_body=1 << 20,
    )
    runner = ProxyThread(config)
    port = runner.start()
    yield Env23(
        workdir,
        recorder,
        origin,
        other,
        hello,
        git,
        grpc_port,
        grpc_seen,
        ws,
        runner,
        port,
        TrafficLog(workdir / "spool"),
    )
    runner.stop()
    origin.shutdown()
    other.shutdown()
    git.shutdown()
    grpc_server.stop(None)
    spool = b"".join(p.read_bytes() for p in (workdir / "spool").glob("*.jsonl"))
    assert TEAM_SECRET.encode() not in spool


def _sse_routes(handler: OriginHandler, seen: Seen) -> None:
    """Server-sent events that echo the request's Authorization in pieces."""
    auth = " ".join(seen.header("authorization"))
    middle = len(auth) // 2
    sse = {"content-type": "text/event-stream"}
    if seen.path.startswith("/sse-split-b64"):
        second = base64.b64encode(auth[middle:].encode()).decode()
        events = [f"data: {auth[:middle]}\n\n", f"data: {second}\n\n"]
    elif seen.path.startswith("/sse-split"):
        events = [f"data: {auth[:middle]}\n\n", f"data: {auth[middle:]}\n\n"]
    elif seen.path.startswith("/sse-deltas"):
        # a streamed completion echoing the credential three characters per event
        events = [
            "data: "
            + json.dumps(
                {
                    "id": "chatcmpl-7",
                    "choices": [{"index": 0, "delta": {"content": auth[i : i + 3]}}],
                }
            )
            + "\n\n"
            for i in range(0, len(auth), 3)
        ]
    elif seen.path.startswith("/sse-as-text"):
        # server-sent events under a content type that does not say so
        events = [f"data: {auth[:middle]}\n\n", f"data: {auth[middle:]}\n\n"]
        sse = {"content-type": "text/plain"}
    elif seen.path.startswith("/ndjson-deltas"):
        # a streamed completion as JSON Lines (Ollama-style), three characters per line
        events = [
            json.dumps({"message": {"content": auth[i : i + 3]}}) + "\n"
            for i in range(0, len(auth), 3)
        ]
        sse = {"content-type": "application/x-ndjson"}
    elif seen.path.startswith("/sse-clean"):
        events = [f"data: event-{index} Bearer T\n\n" for index in range(3)]
    else:
        handler.default(seen)
        return
    handler.chunked([event.encode() for event in events], 0.2, sse)


def _tunnel(env: Env23, target: str, sni: str, alpn: list[str] | None = None) -> ssl.SSLSocket:
    sock = socket.create_connection(("127.0.0.1", env.port), timeout=10)
    sock.sendall(
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
        f"Proxy-Authorization: {auth_header()}\r\n\r\n".encode()
    )
    assert status_of(read_response(sock)) == 200
    context = ssl.create_default_context(cafile=str(env.ca))
    if alpn:
        context.set_alpn_protocols(alpn)
    return context.wrap_socket(sock, server_hostname=sni)


# ------------------------------------------------------------------ 1. the upstream handshake


def test_client_alpn_offers_never_reach_the_origin(env23: Env23) -> None:
    """Fails on the old code: mitmproxy copied the client's ALPN list into the upstream
    ClientHello, so a secret offered as a protocol name reached the origin."""
    target = f"hello.test:{env23.hello.port}"
    sock = _tunnel(env23, target, "hello.test", alpn=["http/1.1", ALPN_SECRET, "spdy/3"])
    assert sock.selected_alpn_protocol() == "http/1.1"
    sock.sendall(f"GET /alpn HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    read_response(sock)  # the recorder is no TLS server: 502
    deadline = time.monotonic() + 5
    while not env23.hello.hellos and time.monotonic() < deadline:
        time.sleep(0.05)
    [hello] = env23.hello.hellos[-1:]
    assert b"http/1.1" in hello  # the recorder sees the ALPN extension
    assert ALPN_SECRET.encode() not in hello
    assert b"spdy/3" not in hello
    assert b"hello.test" in hello  # SNI: the normalized connect host


def test_client_without_h1_offers_gets_http11_upstream(env23: Env23) -> None:
    target = f"hello.test:{env23.hello.port}"
    before = len(env23.hello.hellos)
    sock = _tunnel(env23, target, "HELLO.test", alpn=[ALPN_SECRET])
    sock.sendall(f"GET /alpn2 HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    read_response(sock)
    deadline = time.monotonic() + 5
    while len(env23.hello.hellos) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    hello = env23.hello.hellos[-1]
    assert ALPN_SECRET.encode() not in hello
    assert b"http/1.1" in hello and b"HELLO" not in hello


# ------------------------------------------------------------------ 2. injection bound to the port


def test_injection_is_bound_to_the_rules_port_not_the_host(env23: Env23) -> None:
    """Fails on the old code: injections were bound by host only, so the credential for
    api.test on the origin's port also went to another service on another port of api.test."""
    for port, path in ((env23.origin.port, "/bound-port"), (env23.other.port, "/other-port")):
        target = f"api.test:{port}"
        sock = _tunnel(env23, target, "api.test")
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        assert status_of(read_response(sock)) == 200
    seen = {s.path: s for s in env23.recorder.snapshot()}
    assert seen["/bound-port"].header("authorization") == [f"Bearer {TEAM_SECRET}"]
    assert TEAM_SECRET.encode() not in seen["/other-port"].raw()


# ------------------------------------------------------------------ 3. faults in WebSocket hooks


def _ws_open(env: Env23) -> tuple[ssl.SSLSocket, wsproto.WSConnection]:
    target = f"ws.test:{env.ws.port}"
    sock = _tunnel(env, target, "ws.test")
    ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    sock.sendall(ws.send(wsproto.events.Request(host=target, target="/chat")))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ws.receive_data(sock.recv(65536))
        if any(isinstance(e, wsproto.events.AcceptConnection) for e in ws.events()):
            return sock, ws
    raise AssertionError("websocket not accepted")


def _ws_receive(
    sock: ssl.SSLSocket, ws: wsproto.WSConnection, timeout: float = 4
) -> tuple[str, bool]:
    """Text received until the connection closes (True) or `timeout` passes (False)."""
    text = ""
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return text, True
            ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, wsproto.events.TextMessage):
                    text += event.data
                elif isinstance(event, wsproto.events.CloseConnection):
                    return text, True
    except (OSError, wsproto.utilities.LocalProtocolError):
        return text, False


def _response_guard(env: Env23) -> Any:
    from umbra.proxy.addons.response_guard import ResponseGuard

    master = env.runner.proxy._master
    assert master is not None
    from umbra.proxy.addons.chain import Chain

    [chain] = [addon for addon in master.addons.chain if isinstance(addon, Chain)]
    [guard] = [addon for addon in chain.concerns if isinstance(addon, ResponseGuard)]
    return guard


def test_a_fault_in_a_websocket_hook_closes_both_sides_and_is_recorded(env23: Env23) -> None:
    """Fails on the old code: the fail-closed handler itself failed ("Flow is not killable"),
    the connection stayed open and no record was written."""
    guard = _response_guard(env23)
    original = guard._guards

    def broken(values: list[str]) -> Any:
        raise RuntimeError("reflection guard broke")

    mark = env23.log.mark()
    ended = len(env23.ws.ended)
    sock, ws = _ws_open(env23)
    guard._guards = broken
    try:
        sock.sendall(ws.send(wsproto.events.TextMessage(data="hello")))
        text, closed = _ws_receive(sock, ws)
    finally:
        guard._guards = original
    assert closed and "echo" not in text
    record = env23.log.wait_for(mark, lambda r: r["reason"] == "internal_error")
    assert record["kind"] == "websocket" and "websocket_message" in record["detail"]
    deadline = time.monotonic() + 5
    while len(env23.ws.ended) == ended and time.monotonic() < deadline:
        time.sleep(0.05)
    assert env23.ws.ended[ended:] == ["close 1011"]
    time.sleep(0.3)
    faults = [r for r in env23.log.settled()[mark:] if r["reason"] == "internal_error"]
    assert len(faults) == 1


# ------------------------------------------------------------------ 4. reflection in pieces


@pytest.mark.parametrize("path", ["/sse-split", "/sse-split-b64", "/sse-deltas"])
def test_a_credential_echoed_across_server_sent_events_is_cut(env23: Env23, path: str) -> None:
    """Fails on the old code: each event alone holds no form of the credential, so the pieces
    reached the client (and a client joins them)."""
    mark = env23.log.mark()
    result = _curl(env23, f"https://api.test:{env23.origin.port}{path}")
    assert result.returncode != 0  # cut: no complete response
    received = b"".join(
        base64.b64decode(line[6:])
        if line.startswith(b"data: ") and path.endswith("b64") and i
        else b""
        for i, line in enumerate(result.stdout.split(b"\n\n"))
    )
    for form in (TEAM_SECRET.encode(), TEAM_SECRET.encode()[:8], TEAM_SECRET.encode()[-8:]):
        assert form not in result.stdout and form not in received
    env23.log.wait_for(mark, lambda r: r["reason"] == "credential_reflected")


@pytest.mark.parametrize("path", ["/sse-as-text", "/ndjson-deltas"])
def test_a_credential_echoed_across_undeclared_events_or_json_lines_is_cut(
    env23: Env23, path: str
) -> None:
    """Fails on the old code: only a declared `text/event-stream` was checked event by event, so
    events under another content type, and streamed JSON Lines, reached the client in pieces."""
    mark = env23.log.mark()
    result = _curl(env23, f"https://api.test:{env23.origin.port}{path}")
    assert result.returncode != 0  # cut: no complete response
    joined = b"".join(
        json.loads(line)["message"]["content"].encode()
        if path.startswith("/ndjson")
        else line.removeprefix(b"data: ")
        for line in result.stdout.replace(b"\n\n", b"\n").splitlines()
        if line.strip()
    )
    for form in (TEAM_SECRET.encode(), TEAM_SECRET.encode()[:8], TEAM_SECRET.encode()[-8:]):
        assert form not in result.stdout and form not in joined
    env23.log.wait_for(mark, lambda r: r["reason"] == "credential_reflected")


def test_events_that_only_start_like_a_credential_pass_whole(env23: Env23) -> None:
    result = _curl(env23, f"https://api.test:{env23.origin.port}/sse-clean")
    assert result.returncode == 0
    assert result.stdout == b"".join(b"data: event-%d Bearer T\n\n" % i for i in range(3))


@pytest.mark.parametrize("ask", ["split", "split-b64"])
def test_a_credential_echoed_across_websocket_messages_closes_it(env23: Env23, ask: str) -> None:
    """Fails on the old code: each message was checked alone."""
    mark = env23.log.mark()
    sock, ws = _ws_open(env23)
    sock.sendall(ws.send(wsproto.events.TextMessage(data=ask)))
    text, closed = _ws_receive(sock, ws)
    assert closed
    # neither half reached the client: the first was held until the second showed it continued
    assert text == ""
    env23.log.wait_for(
        mark, lambda r: r["reason"] == "credential_reflected" and r["kind"] == "websocket"
    )


def _curl(env: Env23, url: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [
            "curl",
            "-sS",
            "-N",
            "--max-time",
            "20",
            "--proxy",
            f"http://127.0.0.1:{env.port}",
            "--proxy-user",
            "cvm-alice:alice-tunnel-credential-1",
            "--cacert",
            str(env.ca),
            url,
        ],
        capture_output=True,
        timeout=60,
        check=False,
    )


# ------------------------------------------------------------------ 5. one request, one text

AWS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"


def _split_cases() -> list[tuple[str, str, bytes, str]]:
    cases = []
    for secret in (TEAM_SECRET, AWS_KEY_ID):
        first, second = secret[: len(secret) // 2], secret[len(secret) // 2 :]
        cases += [
            ("body end + header", second, b"notes: " + first.encode(), "text/plain"),
            ("header + form field", first, b"x=" + second.encode() + b"&y=1", "text/plain"),
            ("header + JSON field", first, json.dumps({"k": second}).encode(), "text/plain"),
            (
                "base64 header + body",
                base64.b64encode(first.encode()).decode(),
                second.encode(),
                "",
            ),
            ("header + base64 body", first, base64.b64encode(second.encode()), ""),
        ]
    return cases


@pytest.mark.parametrize(("case", "header", "body", "content_type"), _split_cases())
def test_a_secret_split_between_a_header_and_the_body_is_refused(
    env23: Env23, case: str, header: str, body: bytes, content_type: str
) -> None:
    """Fails on the old code: only a field followed by the body's start was joined, and body
    fields only when the content type said form or JSON."""
    mark = env23.log.mark()
    path = f"/split-{len(env23.recorder.snapshot())}"
    result = subprocess.run(
        [
            "curl",
            "-sS",
            "--max-time",
            "20",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--proxy",
            f"http://127.0.0.1:{env23.port}",
            "--proxy-user",
            "cvm-alice:alice-tunnel-credential-1",
            "--cacert",
            str(env23.ca),
            "-H",
            f"X-Part: {header}",
            "-H",
            f"Content-Type: {content_type}",
            "--data-binary",
            "@-",
            f"https://api.test:{env23.other.port}{path}",
        ],
        input=body,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.stdout == b"403", case
    assert not any(s.path == path for s in env23.recorder.snapshot())
    env23.log.wait_for(mark, lambda r: r["reason"] == "secret_detected")


# ------------------------------------------------------------------ 6. git push limits by ref


def _git(env: Env23, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    home = env.workdir / "git-home"
    home.mkdir(exist_ok=True)
    return subprocess.run(
        [
            "git",
            "-c",
            f"http.proxy=http://cvm-alice:alice-tunnel-credential-1@127.0.0.1:{env.port}",
            "-c",
            f"http.sslCAInfo={env.ca}",
            "-c",
            "user.name=agent",
            "-c",
            "user.email=agent@example.test",
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": os.environ["PATH"], "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1"},
    )


@pytest.fixture(scope="module")
def work(env23: Env23) -> Path:
    work = env23.workdir / "work"
    work.mkdir()
    assert _git(env23, work, "init", "-q", "-b", "main").returncode == 0
    (work / "notes.txt").write_text("agent work\n")
    assert _git(env23, work, "add", "notes.txt").returncode == 0
    assert _git(env23, work, "commit", "-qm", "work").returncode == 0
    return work


def _remote(env: Env23) -> str:
    return f"https://git.test:{env.git.port}/repo.git"


def test_git_push_to_an_allowed_ref_goes_through_and_its_refs_are_recorded(
    env23: Env23, work: Path
) -> None:
    mark = env23.log.mark()
    result = _git(env23, work, "push", _remote(env23), "HEAD:refs/heads/agent/one")
    assert result.returncode == 0, result.stderr
    assert "refs/heads/agent/one" in env23.git.refs("repo.git")
    record = env23.log.wait_for(
        mark, lambda r: r["decision"] == "allow" and "agent/one" in (r["detail"] or "")
    )
    assert record["detail"] == "push create refs/heads/agent/one"
    assert record["rule_id"] == "testing:git-push"


@pytest.mark.parametrize(
    "refspecs",
    [
        ["HEAD:refs/heads/main"],
        ["HEAD:refs/tags/v1"],
        ["HEAD:refs/heads/agent/two", "HEAD:refs/heads/main"],  # one bad ref refuses the push
    ],
)
def test_git_push_to_any_other_ref_is_refused_and_recorded(
    env23: Env23, work: Path, refspecs: list[str]
) -> None:
    """Fails on the old code: an allowed receive-pack could change any ref."""
    mark = env23.log.mark()
    before = env23.git.refs("repo.git")
    result = _git(env23, work, "push", "--atomic", _remote(env23), *refspecs)
    assert result.returncode != 0
    assert env23.git.refs("repo.git") == before
    record = env23.log.wait_for(mark, lambda r: r["reason"] == "push_ref_denied")
    assert "refs/heads/main" in record["detail"] or "refs/tags/v1" in record["detail"]


def test_git_push_deleting_another_ref_is_refused(env23: Env23, work: Path) -> None:
    oid = _git(env23, work, "rev-parse", "HEAD").stdout.strip()
    repo = env23.git.root / "repo.git"
    subprocess.run(["git", "-C", str(repo), "update-ref", "refs/heads/keep", oid], check=True)
    mark = env23.log.mark()
    result = _git(env23, work, "push", _remote(env23), ":refs/heads/keep")
    assert result.returncode != 0
    assert "refs/heads/keep" in env23.git.refs("repo.git")
    record = env23.log.wait_for(mark, lambda r: r["reason"] == "push_ref_denied")
    assert record["detail"] == "push delete refs/heads/keep"


@pytest.mark.parametrize(
    ("body", "what"),
    [
        (b"0032" + b"0" * 40, "truncated pkt-line"),
        (b"zzzz", "not hexadecimal"),
        (b"0000PACK", "no command"),
        (b"003fpush-cert\0 report-status\n" + b"x" * 30 + b"0000", "push certificate"),
    ],
)
def test_a_malformed_push_is_refused_with_its_reason(env23: Env23, body: bytes, what: str) -> None:
    mark = env23.log.mark()
    target = f"git.test:{env23.git.port}"
    sock = _tunnel(env23, target, "git.test")
    sock.sendall(
        f"POST /repo.git/git-receive-pack HTTP/1.1\r\nHost: {target}\r\n"
        f"Content-Type: application/x-git-receive-pack-request\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    assert status_of(read_response(sock)) == 400, what
    env23.log.wait_for(mark, lambda r: r["reason"] == "malformed_push")


# ------------------------------------------------------------------ 7. what a client sends unsaid

AWS_PAIR = (
    "aws_access_key_id = AKIAIOSFODNN7EXAMPLE\n"
    "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\n"
)


def test_git_push_of_a_commit_holding_an_aws_key_pair_is_refused(env23: Env23, work: Path) -> None:
    """Fails on the old code: the packfile's objects are zlib streams the scanner never opened,
    so the push succeeded."""
    keys = env23.workdir / "keys"
    assert _git(env23, work, "clone", "-q", str(work), str(keys)).returncode == 0
    (keys / "credentials").write_text(AWS_PAIR)
    assert _git(env23, keys, "add", "credentials").returncode == 0
    assert _git(env23, keys, "commit", "-qm", "add credentials").returncode == 0
    mark = env23.log.mark()
    result = _git(env23, keys, "push", _remote(env23), "HEAD:refs/heads/agent/keys")
    assert result.returncode != 0
    assert "refs/heads/agent/keys" not in env23.git.refs("repo.git")
    record = env23.log.wait_for(mark, lambda r: r["reason"] == "secret_detected")
    assert "builtin:aws-secret-access-key" in record["scan_rule_ids"]


def _post(env: Env23, body: bytes, content_type: str, *headers: str) -> tuple[int, str]:
    target = f"api.test:{env.other.port}"
    sock = _tunnel(env, target, "api.test")
    extra = "".join(f"{header}\r\n" for header in headers)
    path = f"/unsaid-{time.monotonic_ns()}"
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {target}\r\nContent-Type: {content_type}\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return status_of(read_response(sock)), path


def _zip(name: str, data: bytes, method: int = zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", method) as archive:
        archive.writestr(name, data)
    return buffer.getvalue()


def _raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


def _grpc(message: bytes, compressed: bool) -> bytes:
    return bytes([int(compressed)]) + len(message).to_bytes(4, "big") + message


def _tar_gz(name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _b64_nested(data: bytes, times: int) -> bytes:
    for _ in range(times):
        data = base64.b64encode(data)
    return data


def _b64_hex_json(data: bytes) -> bytes:
    """base64 8 times, with a hex layer and a JSON string (its `A`s escaped) between."""
    data = _b64_nested(data, 4).hex().encode()
    data = json.dumps({"blob": _b64_nested(data, 2).decode()}).replace("A", "\\u0041").encode()
    return _b64_nested(data, 2)


UNSAID = {
    # the decoder stopped after 3 levels: anything deeper passed unscanned
    "base64 nested 5 times": (_b64_nested(AWS_PAIR.encode(), 5), "text/plain", ()),
    "base64 nested 8 times with hex and JSON": (
        _b64_hex_json(AWS_PAIR.encode()),
        "application/octet-stream",
        (),
    ),
    "zip (deflate)": (_zip("creds.txt", AWS_PAIR.encode()), "application/zip", ()),
    "tar.gz": (_tar_gz("creds.txt", AWS_PAIR.encode()), "application/octet-stream", ()),
    "zlib without Content-Encoding": (zlib.compress(AWS_PAIR.encode()), "text/plain", ()),
    "raw deflate without Content-Encoding": (_raw_deflate(AWS_PAIR.encode()), "text/plain", ()),
    "bzip2": (bz2.compress(AWS_PAIR.encode()), "application/octet-stream", ()),
    "xz": (lzma.compress(AWS_PAIR.encode()), "application/octet-stream", ()),
    "grpc deflate": (
        _grpc(zlib.compress(AWS_PAIR.encode()), True),
        "application/grpc",
        ("grpc-encoding: deflate",),
    ),
    "UTF-16 as text/plain": (AWS_PAIR.encode("utf-16-le"), "text/plain", ()),
    "UTF-32 with BOM": (AWS_PAIR.encode("utf-32"), "text/plain", ()),
    "hex character references": (
        "".join(f"&#x{ord(c):x};" for c in AWS_PAIR).encode(),
        "text/html",
        (),
    ),
    "decimal character references": (
        "".join(f"&#{ord(c)};" for c in AWS_PAIR).encode(),
        "application/xml",
        (),
    ),
}


@pytest.mark.parametrize("case", sorted(UNSAID))
def test_a_key_pair_in_content_the_client_does_not_declare_is_refused(
    env23: Env23, case: str
) -> None:
    """Fails on the old code: each of these passed (the issue's black-box round)."""
    body, content_type, headers = UNSAID[case]
    mark = env23.log.mark()
    status, path = _post(env23, body, content_type, *headers)
    assert status == 403, case
    assert not any(s.path == path for s in env23.recorder.snapshot())
    env23.log.wait_for(mark, lambda r: r["reason"] == "secret_detected")


def _nested_zip(depth: int) -> bytes:
    data = b"plain text"
    for index in range(depth):
        data = _zip(f"level-{index}", data)
    return data


MALFORMED = {
    "truncated packfile": (
        b"0000" + b"PACK\x00\x00\x00\x02\x00\x00\x00\x03" + b"\x33\x78\x9c",
        "application/x-git-receive-pack-request",
        (),
        "malformed_packfile",
    ),
    "packfile object of a lying length": (
        b"PACK\x00\x00\x00\x02\x00\x00\x00\x01\x3f" + zlib.compress(b"short"),
        "application/octet-stream",
        (),
        "malformed_packfile",
    ),
    "truncated zip": (_zip("a", b"x" * 4000)[:80], "application/zip", (), "malformed_archive"),
    "zip bomb": (_zip("bomb", b"\0" * (64 << 20)), "application/zip", (), "scan_limit"),
    "zip nested 6 deep": (_nested_zip(6), "application/zip", (), "scan_limit"),
    "base64 nested past the decoder's depth": (
        _b64_nested(b"whatever lies below", MAX_DEPTH + 2),
        "text/plain",
        (),
        "scan_limit",
    ),
    "gRPC frame of a wrong length": (
        b"\x00\x00\x00\x03\xe8abc",
        "application/grpc",
        (),
        "malformed_grpc",
    ),
    "unknown grpc-encoding": (
        _grpc(b"abc", True),
        "application/grpc",
        ("grpc-encoding: snappy",),
        "malformed_grpc",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_or_oversized_containers_are_refused_with_their_reason(
    env23: Env23, case: str
) -> None:
    body, content_type, headers, reason = MALFORMED[case]
    mark = env23.log.mark()
    status, path = _post(env23, body, content_type, *headers)
    assert status in (400, 413), case
    assert not any(s.path == path for s in env23.recorder.snapshot())
    env23.log.wait_for(mark, lambda r: r["reason"] == reason)


@pytest.mark.parametrize(
    "body", [b"x^2 + 1 = y", b"BZh is not bzip2", b"x = 1\n", b"PK but not a zip"]
)
def test_text_that_merely_starts_like_a_container_passes(env23: Env23, body: bytes) -> None:
    status, path = _post(env23, body, "text/plain")
    assert status == 200
    assert any(s.path == path for s in env23.recorder.snapshot())


def test_a_truncated_zlib_stream_is_scanned_as_far_as_it_inflates(env23: Env23) -> None:
    """A two-byte zlib header is a weak sign, so a broken stream is no error, but what inflates
    is scanned (an origin may use that much)."""
    body = zlib.compress(AWS_PAIR.encode() * 4)[:-8]
    mark = env23.log.mark()
    status, _ = _post(env23, body, "application/octet-stream")
    assert status == 403
    env23.log.wait_for(mark, lambda r: r["reason"] == "secret_detected")


def test_websocket_messages_that_only_start_like_a_credential_arrive_in_order(
    env23: Env23,
) -> None:
    sock, ws = _ws_open(env23)
    sock.sendall(ws.send(wsproto.events.TextMessage(data="almost")))
    received: list[str] = []
    sock.settimeout(5)
    while len(received) < 2:
        ws.receive_data(sock.recv(65536))
        received += [e.data for e in ws.events() if isinstance(e, wsproto.events.TextMessage)]
    assert received == ["say Bearer TE", "next"]


def _grpc_call(env: Env23, message: bytes) -> tuple[grpc.StatusCode, bytes]:
    options = [
        ("grpc.http_proxy", f"http://cvm-alice:alice-tunnel-credential-1@127.0.0.1:{env.port}"),
    ]
    credentials = grpc.ssl_channel_credentials(root_certificates=env.ca.read_bytes())
    with grpc.secure_channel(f"grpc.test:{env.grpc_port}", credentials, options) as channel:
        say = channel.unary_unary("/echo.Echo/Say")
        try:
            reply = say(message, timeout=20, compression=grpc.Compression.Deflate)
        except grpc.RpcError as exc:
            return exc.code(), b""
        return grpc.StatusCode.OK, reply


def test_a_grpcio_client_compressing_with_deflate_cannot_carry_a_key_pair(env23: Env23) -> None:
    """A real grpcio client (HTTP/2, `grpc-encoding: deflate`) through the proxy: a clean message
    reaches the server; one holding an AWS key pair is refused (failed on the old code, which
    honoured identity and gzip only)."""
    code, reply = _grpc_call(env23, b"hello " * 20)
    assert (code, reply[:9]) == (grpc.StatusCode.OK, b"ok:hello ")
    mark = env23.log.mark()
    code, _ = _grpc_call(env23, AWS_PAIR.encode() * 3)
    assert code is not grpc.StatusCode.OK
    assert not any(b"AKIA" in message for message in env23.grpc_seen)
    env23.log.wait_for(mark, lambda r: r["reason"] == "secret_detected")
