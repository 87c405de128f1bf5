"""The one place Umbra reaches into mitmproxy internals, checked at start-up.

1. mitmproxy applies `body_size_limit` to requests and responses alike, before any hook runs. Umbra
   needs the limit on requests (a body over it gets 413 and is never forwarded unscanned) but not
   on responses, which are streamed through the reflection guard at any size. `install()` wraps
   `HttpStream.check_body_size` so that, for a response whose flow the addons marked
   `umbra.stream_response`, the limit is skipped; requests keep mitmproxy's own check unchanged.
2. A streamed response cannot be cut from the `flow.response.stream` callable. `install()` wraps
   `HttpStream.state_stream_response_body`: once a flow is marked `umbra.cut_stream`, the client
   stream is reset (a protocol error: HTTP/1 closes the connection, HTTP/2 resets the stream) and
   the server side is dropped, so a cut response never ends as if it were complete.
3. WebSocket control frames (ping, pong, close) are relayed by mitmproxy without any hook, so their
   payloads (up to 125 bytes each) would be an unscanned channel. They are answered hop by hop
   instead: `install()` wraps `WebsocketConnection.send2` so that a ping is answered by the proxy
   with a pong carrying the pinger's own payload, and only an empty ping goes on to the other side
   (keeping that leg alive through idle timeouts); every pong is dropped (the proxy's own pings are
   empty, so their answers carry nothing; any other pong is unsolicited). Close reasons are emptied
   (the close code stays). `send2` can return one command only, so for a ping or pong it returns a
   `_HopByHop` tuple that the wrapped `WebsocketLayer.relay_messages` yields command by command;
   that wrapper also drops mitmproxy's log line for the frame, which quotes its payload. The
   wrapped `WebsocketLayer.start` tells each side's connection its flow and its peer, so that every
   ping or pong payload not relayed is reported (kind, side, size; never the bytes) to the callable
   an addon put in `flow.metadata[WS_CONTROL]` (close reasons stay readable on
   `flow.websocket.close_reason` for the `websocket_end` hook).
4. Worker processes (`--workers`): listeners bind with SO_REUSEPORT (`install(reuse_port=True)`).
5. mitmproxy's WebSocket layer ignores `flow.kill()` (the connection stays open and relays on),
   and a killed flow cannot be killed again ("Flow is not killable"). The wrapped
   `WebsocketLayer.relay_messages` and `start` close the connection instead, after any hook,
   once an addon put a close code in `flow.metadata[CLOSE_WS]` or killed the flow: a close frame
   to each side that is still open (the code, no reason), both connections closed, the
   `websocket_end` hook, and nothing relayed after that.
6. The dial guard dials the checked IP literal, so the upstream connection's address is no longer
   the name the next request on the client connection asks for, and mitmproxy would dial (and
   leave open) a new upstream connection for every request. `install()` wraps
   `GetHttpConnection.connection_spec_matches` so that a connection the dial guard marked as dialled
   for a name (`DIALLED_FOR`) is reused for that name (same TLS, via and transport), as stock
   mitmproxy reuses a connection it resolved itself. Connections are per client connection, so
   reuse never crosses CVMs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Generator
from enum import StrEnum
from typing import Any

import wsproto.events
from mitmproxy import flow as flow_module
from mitmproxy.proxy import commands
from mitmproxy.proxy.layers import http as http_layers
from mitmproxy.proxy.layers import websocket as ws_layers
from mitmproxy.version import VERSION
from wsproto.connection import ConnectionState

STREAM_RESPONSE = "umbra.stream_response"
CUT_STREAM = "umbra.cut_stream"
# flow.metadata key: called as (kind, from_client, payload size) for each ping/pong payload that was
# not relayed (a ping's is answered to its sender, a pong's dropped).
WS_CONTROL = "umbra.ws_control"
# flow.metadata key: a WebSocket close code; once set (by any hook), both sides are closed.
CLOSE_WS = "umbra.close_ws"
WS_POLICY_CLOSE = 1008  # RFC 6455: policy violation
WS_INTERNAL_ERROR = 1011


class ControlKind(StrEnum):
    """A control frame whose payload the proxy did not relay."""

    PING = "ping"  # answered by the proxy with the pinger's own payload
    PONG = "pong"  # dropped


ControlReport = Callable[[ControlKind, bool, int], None]
# Attribute of a mitmproxy Server: the (name, port) the dial guard dialled its IP literal for.
DIALLED_FOR = "umbra_dialled_for"
_installed = False
logger = logging.getLogger(__name__)


class CompatError(RuntimeError):
    pass


def install(*, reuse_port: bool = False) -> None:
    global _installed
    if reuse_port:
        _reuse_port()
    if _installed:
        return
    if not VERSION.startswith("12."):
        raise CompatError(f"Umbra's proxy is built for mitmproxy 12, found {VERSION}")
    stream_cls: Any = getattr(http_layers, "HttpStream", None)
    original = getattr(stream_cls, "check_body_size", None)
    original_stream = getattr(stream_cls, "state_stream_response_body", None)
    errors: Any = getattr(http_layers, "_events", None)
    if original is None or original_stream is None or errors is None:
        raise CompatError("mitmproxy's HttpStream internals are missing; refusing to run")
    protocol_error = errors.ResponseProtocolError
    request_error = errors.RequestProtocolError
    kill_code = errors.ErrorCode.KILL
    send = http_layers.SendHttp

    def check_body_size(self: Any, request: bool) -> Generator[Any, Any, bool]:
        if not request and self.flow.metadata.get(STREAM_RESPONSE):
            if self.flow.response is not None and not self.flow.response.stream:
                self.flow.response.stream = True
            return False
        result: bool = yield from original(self, request)
        return result

    def cut(self: Any) -> Generator[Any, Any, None]:
        yield send(protocol_error(self.stream_id, "response cut", kill_code), self.context.client)
        yield send(request_error(self.stream_id, "response cut", kill_code), self.context.server)
        self.client_state = self.state_errored
        self.server_state = self.state_errored
        self.flow.live = False

    def state_stream_response_body(self: Any, event: Any) -> Generator[Any, Any, None]:
        if self.flow.metadata.get(CUT_STREAM):
            yield from cut(self)
            return
        yield from original_stream(self, event)
        if self.flow.metadata.get(CUT_STREAM):
            yield from cut(self)

    ws_cls: Any = getattr(ws_layers, "WebsocketConnection", None)
    original_send2: Any = getattr(ws_cls, "send2", None)
    layer_cls: Any = getattr(ws_layers, "WebsocketLayer", None)
    original_start: Any = getattr(layer_cls, "start", None)
    original_relay: Any = getattr(layer_cls, "relay_messages", None)
    log_command: Any = getattr(commands, "Log", None)
    end_hook: Any = getattr(ws_layers, "WebsocketEndHook", None)
    killed_message: Any = getattr(getattr(flow_module, "Error", None), "KILLED_MESSAGE", None)
    if None in (
        original_send2,
        original_start,
        original_relay,
        log_command,
        end_hook,
        killed_message,
    ):
        raise CompatError("mitmproxy's WebSocket layer internals are missing; refusing to run")

    def send2(self: Any, event: Any) -> Any:
        # `self` is the side the frame would go to; `umbra_peer` is the side it came from.
        if isinstance(event, wsproto.events.Ping):
            return _HopByHop(_answer_ping(self, bytes(event.payload)))
        if isinstance(event, wsproto.events.Pong):
            if event.payload:
                _report_control(self, ControlKind.PONG, len(event.payload))
            return _HopByHop(())
        if isinstance(event, wsproto.events.CloseConnection) and event.reason:
            event = wsproto.events.CloseConnection(code=event.code, reason="")
        return original_send2(self, event)

    def close_code(self: Any) -> int | None:
        code = self.flow.metadata.get(CLOSE_WS)
        if code is None and self.flow.error is not None and self.flow.error.msg == killed_message:
            code = WS_POLICY_CLOSE
        return int(code) if code is not None else None

    def close_both(self: Any, code: int) -> Generator[Any, Any, None]:
        for ws in (self.server_ws, self.client_ws):
            if ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
                yield ws.send2(wsproto.events.CloseConnection(code=code))
            yield commands.CloseConnection(ws.conn)
        websocket = self.flow.websocket
        if websocket is not None and websocket.timestamp_end is None:
            websocket.timestamp_end = time.time()
            websocket.close_code = code
            yield end_hook(self.flow)
        self.flow.live = False
        self._handle_event = self.done

    def relay_messages(self: Any, event: Any) -> Generator[Any, Any, None]:
        if (code := close_code(self)) is not None:
            yield from close_both(self, code)
            return
        steps = original_relay(self, event)
        reply: Any = None
        # mitmproxy logs each ping/pong with its payload just before relaying it: hold every log
        # line until the next command shows whether it was about a control frame.
        held: Any = None
        while True:
            try:
                command = steps.send(reply)
            except StopIteration:
                break
            reply = None
            if isinstance(command, _HopByHop):
                held = None
                yield from command
                continue
            if held is not None:
                yield held
                held = None
            if isinstance(command, log_command):
                held = command
                continue
            reply = yield command
            if (code := close_code(self)) is not None:
                # A hook asked to close (or killed the flow): relay nothing more.
                steps.close()
                yield from close_both(self, code)
                return
        if held is not None:
            yield held

    def start(self: Any, event: Any) -> Generator[Any, Any, None]:
        yield from original_start(self, event)
        # A frame sent to the server came from the client, and the other way round.
        self.server_ws.umbra_flow, self.server_ws.umbra_from_client = self.flow, True
        self.client_ws.umbra_flow, self.client_ws.umbra_from_client = self.flow, False
        self.server_ws.umbra_peer, self.client_ws.umbra_peer = self.client_ws, self.server_ws
        if (code := close_code(self)) is not None:
            yield from close_both(self, code)

    get_connection: Any = getattr(http_layers, "GetHttpConnection", None)
    original_matches = getattr(get_connection, "connection_spec_matches", None)
    if original_matches is None:
        raise CompatError("mitmproxy's GetHttpConnection internals are missing; refusing to run")

    def connection_spec_matches(self: Any, connection: Any) -> bool:
        if original_matches(self, connection):
            return True
        return bool(
            getattr(connection, DIALLED_FOR, None) == tuple(self.address)
            and self.tls == connection.tls
            and self.via == connection.via
            and self.transport_protocol == connection.transport_protocol
        )

    get_connection.connection_spec_matches = connection_spec_matches
    ws_cls.send2 = send2
    layer_cls.relay_messages = relay_messages
    # `_handle_event` is bound to `start` when the class is defined: replace both.
    layer_cls.start = start
    layer_cls._handle_event = start
    stream_cls.check_body_size = check_body_size
    stream_cls.state_stream_response_body = state_stream_response_body
    _installed = True


class _HopByHop(tuple[Any, ...]):
    """What `send2` returns for a ping or pong: the commands sent instead of relaying it."""


def _answer_ping(ws: Any, payload: bytes) -> list[Any]:
    """A ping from `ws`'s peer: pong the peer with its own payload, send `ws` an empty ping."""
    out: list[Any] = []
    peer = getattr(ws, "umbra_peer", None)
    if peer is not None and peer.state is ConnectionState.OPEN:
        out.append(commands.SendData(peer.conn, peer.send(wsproto.events.Pong(payload=payload))))
    if ws.state is ConnectionState.OPEN:
        out.append(commands.SendData(ws.conn, ws.send(wsproto.events.Ping(payload=b""))))
    if payload:
        _report_control(ws, ControlKind.PING, len(payload))
    return out


def _report_control(ws: Any, kind: ControlKind, size: int) -> None:
    """Tell the flow's addon that a control frame's payload was not relayed (never the payload)."""
    flow = getattr(ws, "umbra_flow", None)
    report: ControlReport | None = flow.metadata.get(WS_CONTROL) if flow is not None else None
    if report is None:
        return
    try:
        report(kind, bool(getattr(ws, "umbra_from_client", False)), size)
    except Exception as exc:
        # The payload is withheld whatever happens here; only the record is lost, and said so.
        logger.error(
            "reporting a withheld WebSocket %s payload failed (%s)", kind, type(exc).__name__
        )


def _reuse_port() -> None:
    """Worker processes: mitmproxy's listeners (and the tunnel endpoint's) bind with SO_REUSEPORT,
    so several processes of the same user share one port and the kernel spreads connections."""
    original = asyncio.start_server
    if getattr(original, "umbra_reuse_port", False):
        return

    async def start_server(*args: Any, **kwargs: Any) -> asyncio.Server:
        kwargs.setdefault("reuse_port", True)
        return await original(*args, **kwargs)

    setattr(start_server, "umbra_reuse_port", True)  # noqa: B010
    # mitmproxy's mode_servers calls `asyncio.start_server` through the module: one assignment.
    asyncio.start_server = start_server
