# mypy: disable-error-code="no-untyped-call"
"""Response guard: responses are streamed, and those to requests that carried an injected
credential are checked for it while they stream (502 / cut, `credential_reflected`).

Headers are checked before anything is passed on; the body goes through the reflection guard chunk
by chunk (`umbra.proxy.reflection`), which holds back only a tail that could start a credential.
WebSocket messages and control frames from the server are checked for every form likewise.
`Alt-Svc` is removed from every response, so clients never learn of HTTP/3 endpoints.
"""

from __future__ import annotations

from collections.abc import Callable

from mitmproxy import ctx, http

from umbra.proxy.addons.base import Shared, UmbraAddon, close_websocket, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import FlowState, Stage, flow_state
from umbra.proxy.mitm_compat import CUT_STREAM, WS_POLICY_CLOSE
from umbra.proxy.reflection import BodyStream, Reflected, ReflectionGuard, UnsupportedEncoding

GuardFactory = Callable[[list[str]], ReflectionGuard]
_MAX_HELD_MESSAGES = 64


class ResponseGuard(UmbraAddon):
    def __init__(self, shared: Shared, guards: GuardFactory = ReflectionGuard) -> None:
        super().__init__(shared)
        self._guards = guards

    def _refuse(self, flow: http.HTTPFlow, detail: str) -> None:
        fstate = flow_state(flow)
        fstate.stage = Stage.DENIED
        flow.metadata[CUT_STREAM] = True
        self.shared.traffic.flow_record(flow, "deny", Reason.CREDENTIAL_REFLECTED, detail)

    @guard
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if response is None:
            return
        while "alt-svc" in response.headers:
            del response.headers["alt-svc"]
        fstate = flow_state(flow)
        if flow.request.method == "CONNECT" or fstate.stage is not Stage.ALLOWED:
            return
        if not fstate.injected_values:
            response.stream = _counter(fstate)
            return
        reflection = self._guards(fstate.injected_values)
        head = "\r\n".join(f"{k}: {v}" for k, v in response.headers.items(multi=True)).encode(
            "utf-8", "surrogateescape"
        )
        status = response.status_code
        if reflection.in_headers(head):
            self._refuse(flow, f"upstream status {status} (headers)")
            flow.kill()
            return
        try:
            body = reflection.stream(
                ",".join(response.headers.get_all("content-encoding")),
                response.headers.get("content-type", ""),
            )
        except UnsupportedEncoding as exc:
            self._refuse(flow, str(exc))
            flow.kill()
            return
        response.stream = self._checked(flow, fstate, body, status)

    def _checked(
        self, flow: http.HTTPFlow, fstate: FlowState, body: BodyStream, status: int
    ) -> Callable[[bytes], bytes]:
        def check(chunk: bytes) -> bytes:
            if flow.metadata.get(CUT_STREAM):
                return b""
            try:
                out = body.feed(chunk) if chunk else body.finish()
            except Reflected as exc:
                self._refuse(flow, f"upstream status {status}: {exc}")
                return b""
            except Exception as exc:
                # The stream callable runs outside any hook: fail closed here too.
                self._refuse(flow, f"internal error in the reflection guard ({type(exc).__name__})")
                return b""
            fstate.response_bytes += len(out)
            return out

        return check

    @guard
    def response(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get(CUT_STREAM) and flow.response is not None:
            flow.kill()

    @guard
    def websocket_message(self, flow: http.HTTPFlow) -> None:
        assert flow.websocket is not None
        message = flow.websocket.messages[-1]
        fstate = flow_state(flow)
        if message.from_client or not fstate.injected_values:
            return
        if message.injected and fstate.ws_releasing:
            fstate.ws_releasing -= 1  # a held message released below: checked already
            return
        if fstate.ws_reassembler is None:
            fstate.ws_reassembler = self._guards(fstate.injected_values).messages()
        try:
            # every form in this message, and a credential in pieces across the connection's
            # messages (each message is one text, as a client reads it)
            if self._guards(fstate.injected_values).in_headers(message.content):
                raise Reflected("message reflects an injected credential")
            pending = fstate.ws_reassembler.add(message.content)
            if pending and len(fstate.ws_held) >= _MAX_HELD_MESSAGES:
                raise Reflected("too many messages continuing the start of a credential")
        except Reflected as exc:
            close_websocket(
                self.shared,
                flow,
                Reason.CREDENTIAL_REFLECTED,
                str(exc),
                WS_POLICY_CLOSE,
                ["reflection"],
            )
            return
        if pending:
            # a start of a credential: held until the next message shows whether it continues
            fstate.ws_held.append((message.content, message.is_text))
            message.drop()
        elif fstate.ws_held:
            # the start broke off: pass the held messages on, then this one, in order
            release = [*fstate.ws_held, (message.content, message.is_text)]
            fstate.ws_held = []
            message.drop()
            for content, is_text in release:
                fstate.ws_releasing += 1
                ctx.master.commands.call("inject.websocket", flow, True, content, is_text)


def _counter(fstate: FlowState) -> Callable[[bytes], bytes]:
    def count(chunk: bytes) -> bytes:
        fstate.response_bytes += len(chunk)
        return chunk

    return count
