"""WebSocket frames are scanned like bodies; raw TCP exists only for explicit tunnel rules."""

from __future__ import annotations

import base64
import json
import time

import wsproto
import wsproto.events

from tests.proxy.conftest import Env
from tests.proxy.harness import (
    ORIGIN_PING,
    TEAM_SECRET,
    connect_tunnel,
    read_response,
    status_of,
)


def _ws_open(env: Env, target: str = "/chat") -> tuple[object, wsproto.WSConnection]:
    sock, _ = connect_tunnel(env.proxy, f"ws.test:{env.ws.port}", sni="ws.test")
    ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    sock.sendall(ws.send(wsproto.events.Request(host=f"ws.test:{env.ws.port}", target=target)))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ws.receive_data(sock.recv(65536))
        if any(isinstance(e, wsproto.events.AcceptConnection) for e in ws.events()):
            return sock, ws
    raise AssertionError("websocket not accepted")


def _recv_until_closed(
    sock: object, ws: wsproto.WSConnection, timeout: float = 1.5
) -> list[object]:
    events: list[object] = []
    sock.settimeout(timeout)  # type: ignore[attr-defined]
    try:
        while True:
            data = sock.recv(65536)  # type: ignore[attr-defined]
            if not data:
                break
            ws.receive_data(data)
            events.extend(ws.events())
    except OSError:
        pass
    return events


def test_clean_websocket_message_passes(env: Env) -> None:
    sock, ws = _ws_open(env)
    sock.sendall(ws.send(wsproto.events.TextMessage(data="hello-clean")))  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while "hello-clean" not in env.ws.messages and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "hello-clean" in env.ws.messages


def test_secret_in_websocket_frame_is_dropped(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, ws = _ws_open(env)
    sock.sendall(ws.send(wsproto.events.TextMessage(data=f"leak {TEAM_SECRET}")))  # type: ignore[attr-defined]
    _recv_until_closed(sock, ws)
    assert not any(TEAM_SECRET in str(m) for m in env.ws.messages)
    record = env.proxy.log.wait_for(mark, lambda r: r["kind"] == "websocket")
    assert record["reason"] == "secret_detected"


def test_secret_split_across_websocket_fragments(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, ws = _ws_open(env)
    half = len(TEAM_SECRET) // 2
    sock.sendall(
        ws.send(wsproto.events.TextMessage(data=TEAM_SECRET[:half], message_finished=False))
    )  # type: ignore[attr-defined]
    sock.sendall(
        ws.send(wsproto.events.TextMessage(data=TEAM_SECRET[half:], message_finished=True))
    )  # type: ignore[attr-defined]
    _recv_until_closed(sock, ws)
    assert not any(
        TEAM_SECRET[:half] in str(m) or TEAM_SECRET[half:] in str(m) for m in env.ws.messages
    )
    env.proxy.log.wait_for(mark, lambda r: r["kind"] == "websocket")


def test_secret_base64_in_binary_websocket_frame(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, ws = _ws_open(env)
    payload = base64.b64encode(TEAM_SECRET.encode())
    sock.sendall(ws.send(wsproto.events.BytesMessage(data=payload)))  # type: ignore[attr-defined]
    _recv_until_closed(sock, ws)
    assert not any(payload in m for m in env.ws.messages if isinstance(m, bytes))
    env.proxy.log.wait_for(mark, lambda r: r["kind"] == "websocket")


def test_websocket_control_frames_are_answered_hop_by_hop_and_logged(env: Env) -> None:
    """Ping, pong and close reason try to carry data both ways. The proxy answers each ping itself
    with the pinger's own payload and sends only an empty ping on; it drops every pong; it empties
    close reasons. No control payload crosses, and each one not relayed is a traffic-log record
    that names its kind, side and size, never its bytes."""
    mark = env.proxy.log.mark()
    sock, ws = _ws_open(env, "/control")
    secret = TEAM_SECRET.encode()
    unsolicited = b"unsolicited-" + secret
    sock.sendall(ws.send(wsproto.events.Ping(payload=secret)))  # type: ignore[attr-defined]
    sock.sendall(ws.send(wsproto.events.Pong(payload=unsolicited)))  # type: ignore[attr-defined]
    # The origin answers with a ping of its own carrying `ORIGIN_PING`.
    sock.sendall(ws.send(wsproto.events.TextMessage(data="ping-me")))  # type: ignore[attr-defined]
    pongs: list[bytes] = []
    pings: list[bytes] = []
    received = b""
    sock.settimeout(5)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while not (pongs and pings) and time.monotonic() < deadline:
        data = sock.recv(65536)  # type: ignore[attr-defined]
        received += data
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, wsproto.events.Pong):
                pongs.append(bytes(event.payload))
            elif isinstance(event, wsproto.events.Ping):
                pings.append(bytes(event.payload))
                sock.sendall(ws.send(event.response()))  # type: ignore[attr-defined]
    assert pongs == [secret], "the proxy answers the client's ping with the client's own payload"
    assert pings == [b""], "the origin's ping reaches the client only as the proxy's empty ping"
    assert ORIGIN_PING not in received and b"origin-pong-data" not in received
    sock.sendall(ws.send(wsproto.events.CloseConnection(code=1000, reason=TEAM_SECRET)))  # type: ignore[attr-defined]
    _recv_until_closed(sock, ws)
    expected = [("ping", b""), ("pong", ORIGIN_PING), ("close", b"")]

    def seen() -> list[tuple[str, bytes]]:
        return [(kind, payload) for target, kind, payload in env.ws.control if target == "/control"]

    deadline = time.monotonic() + 5
    while len(seen()) < len(expected) and time.monotonic() < deadline:
        time.sleep(0.05)
    # The origin got the proxy's empty ping, its own ping's payload back, and a close without
    # reason: never the client's ping, its unsolicited pong, or its pong to the proxy's ping.
    assert seen() == expected

    def control(detail: str) -> dict[str, object]:
        return env.proxy.log.wait_for(
            mark,
            lambda r: (
                r["reason"] == "ws_control_not_relayed" and str(r["detail"]).startswith(detail)
            ),
        )

    size = len(secret)
    ping = control(f"ping from client: {size}-byte payload answered by the proxy, not relayed")
    assert ping["kind"] == "websocket" and ping["decision"] == "deny"
    assert ping["cvm_id"] == "cvm-alice" and ping["bytes_sent"] == size
    assert ping["path"] == "/control" and ping["rule_id"] == "testing:ws"
    unsolicited_record = control(f"pong from client: {len(unsolicited)}-byte payload dropped")
    assert unsolicited_record["bytes_sent"] == len(unsolicited)
    assert control("pong from server: 16-byte payload dropped")["bytes_received"] == 16
    origin_ping = control(f"ping from server: {len(ORIGIN_PING)}-byte payload answered")
    assert origin_ping["bytes_received"] == len(ORIGIN_PING)
    close = control(f"close (code 1000) from client: {size}-byte reason emptied")
    assert close["bytes_sent"] == size
    for record in env.proxy.log.settled()[mark:]:
        assert TEAM_SECRET not in json.dumps(record)
        assert ORIGIN_PING.decode() not in json.dumps(record)


def test_explicit_tunnel_carries_raw_tcp(env: Env) -> None:
    mark = env.proxy.log.mark()
    sock, response = connect_tunnel(env.proxy, f"tcp.test:{env.tcp.port}", sni=None, tls=False)
    assert status_of(response) == 200
    sock.settimeout(5)
    # Like SSH, the client speaks first (mitmproxy picks the layer when the client sends).
    sock.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
    received = b""
    while len(received) < len(b"HELLO-TCP\nSSH-2.0-OpenSSH_9.6\r\n"):
        chunk = sock.recv(100)
        if not chunk:
            break
        received += chunk
    assert received == b"HELLO-TCP\nSSH-2.0-OpenSSH_9.6\r\n"
    record = env.proxy.log.wait_for(mark, lambda r: r["kind"] == "tunnel")
    assert record["decision"] == "allow" and record["rule_id"] == "testing:raw"


def test_no_raw_tcp_without_a_tunnel_rule(env: Env) -> None:
    """api.test is allowed for HTTP only: raw bytes to it are parsed as HTTP and refused."""
    before = env.tcp.connections
    sock, response = connect_tunnel(env.proxy, f"api.test:{env.tcp.port}", sni=None, tls=False)
    assert status_of(response) == 200  # CONNECT itself is answered lazily; nothing is dialled yet
    sock.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
    reply = read_response(sock, timeout=3)
    assert b"HELLO-TCP" not in reply
    assert env.tcp.connections == before
