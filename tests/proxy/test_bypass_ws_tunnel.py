"""WebSocket frames are scanned like bodies; raw TCP exists only for explicit tunnel rules."""

from __future__ import annotations

import base64
import json
import time

import wsproto
import wsproto.events

from tests.proxy.conftest import Env
from tests.proxy.harness import TEAM_SECRET, connect_tunnel, read_response, status_of


def _ws_open(env: Env) -> tuple[object, wsproto.WSConnection]:
    sock, _ = connect_tunnel(env.proxy, f"ws.test:{env.ws.port}", sni="ws.test")
    ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    sock.sendall(ws.send(wsproto.events.Request(host=f"ws.test:{env.ws.port}", target="/chat")))
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


def test_websocket_control_frames_are_emptied_and_logged(env: Env) -> None:
    """Ping, pong and close reason carry a secret both ways: the payloads are emptied, the frames
    still pass (the connection keeps working), and each emptied frame is a traffic-log record that
    names its kind, side and size, never its bytes."""
    mark = env.proxy.log.mark()
    sock, ws = _ws_open(env)
    secret = TEAM_SECRET.encode()
    unsolicited = b"unsolicited-" + secret
    sock.sendall(ws.send(wsproto.events.Ping(payload=secret)))  # type: ignore[attr-defined]
    sock.sendall(ws.send(wsproto.events.Pong(payload=unsolicited)))  # type: ignore[attr-defined]
    pongs: list[bytes] = []
    sock.settimeout(5)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while not pongs and time.monotonic() < deadline:
        ws.receive_data(sock.recv(65536))  # type: ignore[attr-defined]
        pongs += [bytes(e.payload) for e in ws.events() if isinstance(e, wsproto.events.Pong)]
    assert pongs == [b""], "the origin's pong arrives, without its payload"
    sock.sendall(ws.send(wsproto.events.CloseConnection(code=1000, reason=TEAM_SECRET)))  # type: ignore[attr-defined]
    _recv_until_closed(sock, ws)
    deadline = time.monotonic() + 5
    while len(env.ws.control) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = {kind: payload for kind, payload in env.ws.control[-3:]}
    assert seen == {"ping": b"", "pong": b"", "close": b""}, env.ws.control

    def control(detail: str) -> dict[str, object]:
        return env.proxy.log.wait_for(
            mark,
            lambda r: r["reason"] == "ws_control_emptied" and str(r["detail"]).startswith(detail),
        )

    size = len(secret)
    ping = control(f"ping from client: {size}-byte payload emptied")
    assert ping["kind"] == "websocket" and ping["decision"] == "deny"
    assert ping["cvm_id"] == "cvm-alice" and ping["bytes_sent"] == size
    assert ping["path"] == "/chat" and ping["rule_id"] == "testing:ws"
    assert control(f"pong from client: {len(unsolicited)}-byte")["bytes_sent"] == len(unsolicited)
    assert control("pong from server: 16-byte")["bytes_received"] == 16
    close = control(f"close (code 1000) from client: {size}-byte reason emptied")
    assert close["bytes_sent"] == size
    for record in env.proxy.log.records()[mark:]:
        assert TEAM_SECRET not in json.dumps(record)


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
