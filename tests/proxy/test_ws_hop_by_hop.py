"""mitm_compat's hop-by-hop WebSocket control frames, in-process: mitmproxy's own WebsocketLayer is
fed real frames (wsproto on both ends) and the commands it yields are decoded, so what each side
would receive is checked byte for byte, with no sockets."""

from __future__ import annotations

from typing import Any

import pytest
import wsproto.events
from mitmproxy import options
from mitmproxy.proxy import commands, context, events
from mitmproxy.proxy.layers import websocket
from mitmproxy.test import tflow
from wsproto.connection import Connection, ConnectionType
from wsproto.events import Event

from umbra.proxy import mitm_compat

PAYLOAD = b"covert-ping-payload"


class Harness:
    """One WebsocketLayer between a wsproto client and a wsproto server."""

    def __init__(self) -> None:
        mitm_compat.install()
        self.flow = tflow.twebsocketflow()
        self.reports: list[tuple[str, bool, int]] = []
        ctx = context.Context(self.flow.client_conn, options.Options())
        ctx.server = self.flow.server_conn
        self.layer = websocket.WebsocketLayer(ctx, self.flow)
        self.client = Connection(ConnectionType.CLIENT)
        self.server = Connection(ConnectionType.SERVER)
        self.commands: list[Any] = []
        self.feed(events.Start())
        self.flow.metadata[mitm_compat.WS_CONTROL] = lambda *a: self.reports.append(a)

    def feed(self, event: events.Event) -> None:
        pending = list(self.layer.handle_event(event))
        while pending:
            command = pending.pop(0)
            self.commands.append(command)
            if isinstance(command, commands.StartHook):
                pending += list(self.layer.handle_event(events.HookCompleted(command)))

    def from_client(self, event: Event) -> None:
        self.feed(events.DataReceived(self.flow.client_conn, self.client.send(event)))

    def from_server(self, event: Event) -> None:
        self.feed(events.DataReceived(self.flow.server_conn, self.server.send(event)))

    def received(self) -> tuple[list[Event], list[Event]]:
        """What the client and the server would receive from the proxy, decoded."""
        for command in self.commands:
            if isinstance(command, commands.SendData):
                side = self.client if command.connection is self.flow.client_conn else self.server
                side.receive_data(command.data)
        self.commands = [c for c in self.commands if not isinstance(c, commands.SendData)]
        return list(self.client.events()), list(self.server.events())


@pytest.mark.parametrize("pinger", ["client", "server"])
def test_ping_is_answered_by_the_proxy_and_an_empty_ping_goes_on(pinger: str) -> None:
    h = Harness()
    send = h.from_client if pinger == "client" else h.from_server
    send(wsproto.events.Ping(payload=PAYLOAD))
    to_client, to_server = h.received()
    own, other = (to_client, to_server) if pinger == "client" else (to_server, to_client)
    assert own == [wsproto.events.Pong(payload=PAYLOAD)]
    assert other == [wsproto.events.Ping(payload=b"")]
    assert h.reports == [(mitm_compat.ControlKind.PING, pinger == "client", len(PAYLOAD))]
    # mitmproxy's log line for the ping quotes its payload: it is not emitted.
    assert not any(PAYLOAD in repr(c).encode() for c in h.commands)


@pytest.mark.parametrize("sender", ["client", "server"])
def test_pongs_are_dropped(sender: str) -> None:
    h = Harness()
    send = h.from_client if sender == "client" else h.from_server
    send(wsproto.events.Pong(payload=PAYLOAD))
    send(wsproto.events.Pong(payload=b""))
    assert h.received() == ([], [])
    assert h.reports == [(mitm_compat.ControlKind.PONG, sender == "client", len(PAYLOAD))]


def test_messages_still_pass_and_close_reasons_are_emptied() -> None:
    h = Harness()
    h.from_client(wsproto.events.TextMessage(data="hello"))
    h.from_server(wsproto.events.Ping(payload=b""))
    h.from_client(wsproto.events.CloseConnection(code=1000, reason="covert-reason"))
    to_client, to_server = h.received()
    assert to_server == [
        wsproto.events.TextMessage(data="hello"),
        wsproto.events.Pong(payload=b""),
        wsproto.events.CloseConnection(code=1000, reason=""),
    ]
    assert to_client == [
        wsproto.events.Ping(payload=b""),
        wsproto.events.CloseConnection(code=1000, reason=""),
    ]
    # An empty ping is answered and passed on, but nothing was withheld: no report.
    assert h.reports == []
