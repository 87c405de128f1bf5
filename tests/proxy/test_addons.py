"""Each addon in-process with mitmproxy's test helpers (`taddons`, `tflow`): real policy, real
scanner, real spool; failing dependencies are injected, never switched on in production code."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import http, websocket
from mitmproxy.proxy import server_hooks
from mitmproxy.test import taddons, tflow, tutils

from umbra.policy.loader import load_policy_dir
from umbra.proxy.addons import AddonConfig, Reason, Shared, build_addons
from umbra.proxy.addons.identity import Identity
from umbra.proxy.addons.response_guard import ResponseGuard
from umbra.proxy.addons.state import flow_state
from umbra.proxy.identity import CvmIdentity
from umbra.proxy.netcheck import AddressPolicy
from umbra.proxy.reflection import ReflectionGuard
from umbra.proxy.resolver import StaticResolver
from umbra.proxy.secrets import SecretStore
from umbra.proxy.spool import Spool
from umbra.proxy.state import PolicyState

TOKEN = "tok-9f8e7d6c5b4a39281706"
LATE = "late-secret-0a1b2c3d4e5f6071"
ALICE = CvmIdentity("cvm-a", "alice", "team", ("p",))

POLICY = """
apiVersion: umbra/v1
kind: Profile
name: p
egress:
  - id: api
    allow: {hosts: [api.test], ports: [443]}
  - id: admin
    deny: {hosts: [api.test], ports: [443], paths: ["/admin/**"]}
  - id: ro
    allow: {hosts: [ro.test], ports: [443], methods: [GET, HEAD]}
inject:
  - {id: bearer, header: Authorization, format: "Bearer {secret}", secret: team/tok, hosts: [api.test], ports: [443]}
"""


class Identities:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def by_source(self, host: str, port: int) -> CvmIdentity | None:
        if self.fail:
            raise RuntimeError("identity source broke")
        return ALICE

    def by_proxy_auth(self, header: str) -> CvmIdentity | None:
        return None


class BrokenState(PolicyState):
    def effective(self, identity: CvmIdentity) -> Any:
        raise RuntimeError("policy state broke")


class Env:
    def __init__(
        self,
        tmp: Path,
        *,
        identities: Identities | None = None,
        broken: bool = False,
        max_body: int = 1 << 20,
    ):
        (tmp / "pol").mkdir(exist_ok=True)
        (tmp / "pol" / "p.yaml").write_text(POLICY)
        secrets = SecretStore({"tok": TOKEN}, {})
        self.state = (BrokenState if broken else PolicyState)(secrets)
        self.state.install(policy_set=load_policy_dir(tmp / "pol"))
        self.spool_dir = tmp / "spool"
        self.spool = Spool(self.spool_dir)
        self.closed = False
        resolver_file = tmp / "resolver.json"
        resolver_file.write_text(json.dumps({"api.test": ["93.184.216.34"]}))
        self.shared = Shared(
            AddonConfig(
                state=self.state,
                identities=identities or Identities(),
                resolver=StaticResolver.from_file(resolver_file),
                addresses=AddressPolicy(),
                spool=self.spool,
                max_body=max_body,
            )
        )
        self.addons = build_addons(self.shared)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.spool.close()

    def records(self) -> list[dict[str, Any]]:
        self.close()
        return [
            json.loads(line)
            for path in sorted(self.spool_dir.glob("*.jsonl"))
            for line in path.read_text().splitlines()
        ]

    def raw_log(self) -> bytes:
        self.close()
        return b"".join(path.read_bytes() for path in self.spool_dir.glob("*.jsonl"))


async def _hook(addons: list[object], name: str, target: Any) -> None:
    for addon in addons:
        method = getattr(addon, name, None)
        if method is not None:
            result = method(target)
            if asyncio.iscoroutine(result):
                await result


def run(env: Env, name: str, target: Any) -> None:
    asyncio.run(_hook(env.addons, name, target))


def request_flow(
    host: str = "api.test", path: str = "/x", method: str = "GET", **headers: str
) -> http.HTTPFlow:
    flow = tflow.tflow(
        req=tutils.treq(
            host=host,
            port=443,
            scheme=b"https",
            method=method.encode(),
            path=path.encode(),
            headers=http.Headers(host=host, **headers),
            content=b"",
        )
    )
    flow.client_conn.tls = False
    flow.client_conn.peername = ("127.0.0.1", 40000)
    return flow


def send(env: Env, flow: http.HTTPFlow) -> http.HTTPFlow:
    run(env, "client_connected", flow.client_conn)
    run(env, "requestheaders", flow)
    run(env, "request", flow)
    return flow


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    with taddons.context():
        environment = Env(tmp_path)
        yield environment
        environment.close()


def test_allowed_request_is_injected_and_authorized(env: Env) -> None:
    flow = send(env, request_flow())
    assert flow.response is None
    assert flow.request.headers["authorization"] == f"Bearer {TOKEN}"
    assert ("api.test", 443) in env.shared.conns.get(flow.client_conn).authorized


@pytest.mark.parametrize(
    ("flow_args", "reason"),
    [
        ({"path": "/admin/users"}, Reason.RULE_DENY),
        ({"path": "/admin;p/users"}, Reason.INVALID_PATH),
        ({"path": "/x;jsessionid=1"}, Reason.INVALID_PATH),
        ({"host": "ro.test", "x_http_method_override": "DELETE"}, Reason.METHOD_OVERRIDE),
        ({"host": "ro.test", "x_http_method": "DELETE"}, Reason.METHOD_OVERRIDE),
        ({"host": "ro.test", "x_method_override": "PUT"}, Reason.METHOD_OVERRIDE),
        ({"host": "evil.test"}, Reason.NO_MATCHING_RULE),
    ],
)
def test_denials_carry_their_reason_and_status(
    env: Env, flow_args: dict[str, str], reason: Reason
) -> None:
    flow = send(env, request_flow(**flow_args))
    assert flow.response is not None and flow.response.status_code == reason.status
    assert flow.response.headers["x-umbra-reason"] == reason
    assert "authorization" not in flow.request.headers
    (record,) = env.records()
    assert record["reason"] == reason and record["status"] == reason.status


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        # Raw header fields, any case: the sanity checks read them in one pass.
        (
            [(b"X-HTTP-Method-Override", b"DELETE"), (b"Content-Length", b"x")],
            Reason.METHOD_OVERRIDE,
        ),
        ([(b"UPGRADE", b"h2c")], Reason.UPGRADE_REFUSED),
        ([(b"Upgrade", b"websocket"), (b"Upgrade", b"websocket")], Reason.UPGRADE_REFUSED),
        ([(b"HTTP2-Settings", b"AAMAAABkAAQAAP__")], Reason.UPGRADE_REFUSED),
        ([(b"Transfer-Encoding", b"chunked"), (b"CONTENT-LENGTH", b"5")], Reason.SMUGGLING),
        ([(b"transfer-encoding", b"gzip, chunked")], Reason.SMUGGLING),
        ([(b"Content-Length", b"5"), (b"content-length", b"5")], Reason.SMUGGLING),
        ([(b"Content-Length", b"+5")], Reason.SMUGGLING),
        ([(b"Content-Length", str(2 << 20).encode())], Reason.BODY_TOO_LARGE),
        ([(b"X-A", b"one\x00two")], Reason.SMUGGLING),
        ([(b"X-A", b"one\ntwo"), (b"Content-Length", b"x")], Reason.SMUGGLING),
    ],
)
def test_request_sanity_reads_raw_fields_in_any_case(
    env: Env, fields: list[tuple[bytes, bytes]], reason: Reason
) -> None:
    flow = request_flow()
    for name, value in fields:
        flow.request.headers.fields += ((name, value),)
    flow = send(env, flow)
    assert flow.response is not None
    assert flow.response.headers["x-umbra-reason"] == reason


def test_secret_in_path_is_redacted_from_the_record(env: Env) -> None:
    token = "ghp_" + "A1b2C3d4" * 5
    flow = send(env, request_flow(path=f"/p/{token}?k={token}"))
    assert flow.response is not None and flow.response.status_code == 403
    log = env.raw_log()
    assert token.encode() not in log and token[:20].encode() not in log
    assert env.records()[0]["reason"] == Reason.SECRET_DETECTED


def test_secrets_released_after_start_are_redacted(env: Env) -> None:
    """The redactor follows the secret store: a secret released later is redacted too."""
    env.state.install_secrets(SecretStore({"tok": TOKEN, "late": LATE}, {}))
    flow = send(env, request_flow(host="evil.test", path=f"/{LATE}"))
    assert flow.response is not None
    assert LATE.encode() not in env.raw_log()


def test_identity_failure_poisons_the_connection(tmp_path: Path) -> None:
    with taddons.context():
        env = Env(tmp_path, identities=Identities(fail=True))
        flow = send(env, request_flow())
        assert flow.response is not None and flow.response.status_code == 500
        assert env.records()[0]["reason"] == Reason.INTERNAL_ERROR


def test_policy_state_failure_denies(tmp_path: Path) -> None:
    with taddons.context():
        env = Env(tmp_path, broken=True)
        flow = send(env, request_flow())
        assert flow.response is not None and flow.response.status_code == 500
        assert "authorization" not in flow.request.headers
        record = env.records()[0]
        assert record["reason"] == Reason.INTERNAL_ERROR and "requestheaders" in record["detail"]


def test_tcp_start_failure_stops_the_relay(env: Env) -> None:
    """An exception in tcp_start poisons the connection: the dial guard then refuses to dial."""
    flow = tflow.ttcpflow()

    class Exploding(Identity):
        def tcp_start(self, _flow: object) -> None:
            raise RuntimeError("boom")

    from umbra.proxy.addons.base import guard

    exploding = Exploding(env.shared)
    guard(Exploding.tcp_start)(exploding, flow)  # a sync hook stays sync under the guard
    assert env.shared.conns.get(flow.client_conn).poisoned
    data = server_hooks.ServerConnectionHookData(flow.server_conn, flow.client_conn)
    flow.server_conn.address = ("93.184.216.34", 443)
    run(env, "server_connect", data)
    assert data.server.error and "poisoned" in data.server.error


def test_response_guard_failure_withholds_the_response(env: Env) -> None:
    def broken(values: list[str]) -> ReflectionGuard:
        raise RuntimeError("guard broke")

    env.addons = [
        a if not isinstance(a, ResponseGuard) else ResponseGuard(env.shared, broken)
        for a in env.addons
    ]
    flow = send(env, request_flow())
    flow.response = tutils.tresp(content=b"hello")
    run(env, "responseheaders", flow)
    assert flow.response.status_code == 502
    assert flow.error is not None  # killed
    assert env.records()[-1]["reason"] == Reason.INTERNAL_ERROR


def test_websocket_reflection_is_checked_in_every_form(env: Env) -> None:
    flow = send(env, request_flow(path="/ws"))
    flow.websocket = tflow.twebsocket(messages=False)
    assert flow_state(flow).injected_values
    assert flow.websocket is not None
    flow.websocket.messages.append(
        websocket.WebSocketMessage(2, False, base64.b64encode(f"Bearer {TOKEN}".encode()))
    )
    run(env, "websocket_message", flow)
    assert flow.websocket.messages[-1].dropped
    assert env.records()[-1]["reason"] == Reason.CREDENTIAL_REFLECTED


GHP = "ghp_" + "Zq9Xw8Vu7Ts6Rp5On4Ml3Kj2Ih1Gf0Ed9Cb8A"
GCP = "AIza" + "SyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6-"  # ends in '-': no word boundary after it


def _post(env: Env, body: bytes, content_type: str, path: str = "/up", **headers: str) -> Any:
    flow = request_flow(path=path, method="POST", **headers)
    flow.request.headers["content-type"] = content_type
    flow.request.content = body
    return send(env, flow)


@pytest.mark.parametrize(
    ("path", "body", "content_type", "headers"),
    [
        # a secret split in two: query parameters, headers, form fields, JSON fields, cookies,
        # header + body
        (f"/q?a={GHP[:20]}&b={GHP[20:]}", b"", "text/plain", {}),
        ("/h", b"", "text/plain", {"x_one": GHP[:20], "x_two": GHP[20:]}),
        ("/f", f"a={GHP[:20]}&b={GHP[20:]}".encode(), "application/x-www-form-urlencoded", {}),
        ("/j", json.dumps({"a": GHP[20:], "b": GHP[:20]}).encode(), "application/json", {}),
        ("/c", b"", "text/plain", {"cookie": f"a={GHP[:20]}; b={GHP[20:]}"}),
        ("/hb", GHP[20:].encode(), "text/plain", {"x_one": GHP[:20]}),
        # encodings the scanner must decode at the token
        ("/w", base64.encodebytes(b"z" * 90 + GHP.encode()), "text/plain", {}),
        (f"/p/{base64.b64encode(b'xy' + GHP.encode()).decode()}", b"", "text/plain", {}),
        ("/u", b"/p/" + base64.urlsafe_b64encode(b"\xfb\xff" + GHP.encode()), "text/plain", {}),
        # binary bodies and tokens next to word characters
        ("/b", b"\x0a\x28J" + GHP.encode() + b"\xff\xfe", "application/x-protobuf", {}),
        ("/k", b"key=" + GCP.encode(), "text/plain", {}),
    ],
)
def test_secrets_the_scanner_must_find(
    env: Env, path: str, body: bytes, content_type: str, headers: dict[str, str]
) -> None:
    flow = _post(env, body, content_type, path=path, **headers)
    assert flow.response is not None and flow.response.status_code == 403, path
    assert env.records()[0]["reason"] == Reason.SECRET_DETECTED


def test_clean_request_with_many_fields_passes(env: Env) -> None:
    body = json.dumps({f"k{index}": f"value number {index}" for index in range(40)}).encode()
    flow = _post(env, body, "application/json", path="/ok?a=1&b=2", x_one="abc")
    assert flow.response is None


def test_a_large_scan_does_not_stop_the_event_loop(tmp_path: Path) -> None:
    """While a 10 MiB body is decoded and scanned, the loop keeps running other work."""
    with taddons.context():
        env = Env(tmp_path, max_body=16 << 20)
        body = (b"x=" + base64.b64encode(bytes(range(256)) * 2048) + b"&") * 10
        flow = request_flow(method="POST")
        flow.request.headers["content-type"] = "application/x-www-form-urlencoded"
        flow.request.content = body[: 10 << 20]
        run(env, "client_connected", flow.client_conn)
        run(env, "requestheaders", flow)

        async def scenario() -> tuple[int, bool]:
            ticks = 0
            scan = asyncio.ensure_future(_hook(env.addons, "request", flow))
            while not scan.done():
                ticks += 1
                await asyncio.sleep(0.001)
            await scan
            return ticks, flow.response is None

        ticks, forwarded = asyncio.run(scenario())
        env.close()
        assert forwarded
        assert ticks >= 5, f"the loop ran only {ticks} times during the scan"
