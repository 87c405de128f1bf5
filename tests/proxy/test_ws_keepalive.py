"""Real WebSocket keep-alive through the proxy: `websockets` on both sides, each pinging with a
random payload and closing the connection when no pong carries it back. The proxy answers pings
hop by hop, so both keep-alives hold while no control payload crosses."""

from __future__ import annotations

import ssl
import time

import websockets.sync.client
from websockets.frames import Opcode

from tests.proxy.conftest import Env
from tests.proxy.harness import FrameLog, KeepAliveOrigin, connect_tunnel, status_of

# Several keep-alive intervals of both sides (0.5 s each, 1 s timeout).
DURATION = 3.0


def test_websockets_keepalive_holds_through_the_proxy(env: Env) -> None:
    mark = env.proxy.log.mark()
    origin = env.keepalive
    del origin.log.frames[:]
    client_log = FrameLog("uws.client")
    sock, response = connect_tunnel(env.proxy, f"ws.test:{origin.port}", sni=None, tls=False)
    assert status_of(response) == 200
    tls = ssl.create_default_context(cafile=str(env.proxy.ca))
    with websockets.sync.client.connect(
        f"wss://ws.test:{origin.port}/stream",
        sock=sock,
        ssl=tls,
        server_hostname="ws.test",
        proxy=None,
        ping_interval=KeepAliveOrigin.INTERVAL,
        ping_timeout=KeepAliveOrigin.TIMEOUT,
        logger=client_log.logger,
    ) as client:
        deadline = time.monotonic() + DURATION
        sent = 0
        while time.monotonic() < deadline:
            client.send(f"tick-{sent}")
            # A keep-alive that failed on either side closes the connection: recv raises.
            assert client.recv(timeout=2) == f"tick-{sent}"
            sent += 1
            time.sleep(0.1)
        client_pings = client_log.payloads(">", Opcode.PING)
        client_pongs = client_log.payloads("<", Opcode.PONG)
        origin_pings = origin.log.payloads(">", Opcode.PING)
        origin_pongs = origin.log.payloads("<", Opcode.PONG)
    client_log.logger.removeHandler(client_log)

    # Both keep-alives ran several rounds and each side got its own payloads back.
    assert len(client_pings) >= 4 and len(origin_pings) >= 4, (client_pings, origin_pings)
    assert all(p for p in client_pings + origin_pings), "websockets pings carry a random payload"
    assert set(client_pings[:-1]) <= set(client_pongs)
    assert set(origin_pings[:-1]) <= set(origin_pongs)
    # Neither side's payload crossed: what each received from the other side's keep-alive is the
    # proxy's empty ping, and no frame carried the other side's ping payload (unmasked bytes).
    assert set(client_log.payloads("<", Opcode.PING)) == {b""}
    assert set(origin.log.payloads("<", Opcode.PING)) == {b""}
    for payload in client_pings:
        assert not origin.log.carried(payload)
    for payload in origin_pings:
        assert not client_log.carried(payload)
    # What the proxy answered itself is on the record, by size only and bounded per connection:
    # the first ping of each side at once, the rest in one summary when the connection ends.
    summary = env.proxy.log.wait_for(
        mark, lambda r: "more ping frames from client" in str(r["detail"])
    )
    assert int(str(summary["detail"]).split()[0]) >= 3, summary
    answered = [
        r
        for r in env.proxy.log.settled()[mark:]
        if r["reason"] == "ws_control_not_relayed" and r["path"] == "/stream"
    ]
    assert [str(r["detail"]).startswith("ping from client: 4-byte") for r in answered].count(
        True
    ) == 1
    assert len(answered) <= 4  # first + summary, per side
    assert any(str(r["detail"]).startswith("ping from server: 4-byte") for r in answered)
