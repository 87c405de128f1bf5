# mypy: disable-error-code="no-untyped-call"
"""Scanning: secrets and placeholders in the request head and decoded body, and in WebSocket
messages from the client (403 `secret_detected`, 400 `undecodable_content`, 413 on limits)."""

from __future__ import annotations

from mitmproxy import http

from umbra.proxy.addons.base import Denied, UmbraAddon, deny, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import FlowState, Stage, flow_state
from umbra.proxy.decode import DecodeError, DecodeLimit, content_decode
from umbra.proxy.scanner import ScanError


class Scan(UmbraAddon):
    @guard
    def request(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT":
            return
        fstate = flow_state(flow)
        if fstate.denied or flow.response is not None:
            if not fstate.logged:
                deny(self.shared, flow, Denied(Reason.DENIED, "answered before forwarding"))
            return
        try:
            if fstate.stage is not Stage.GATED:
                raise Denied(Reason.NOT_DECIDED, "request was not checked")
            self.scan(flow, fstate)
        except Denied as denial:
            deny(self.shared, flow, denial)

    def scan(self, flow: http.HTTPFlow, fstate: FlowState) -> None:
        assert fstate.effective is not None
        max_body = self.shared.max_body
        request = flow.request
        body = request.raw_content or b""
        if len(body) > max_body:
            raise Denied(Reason.BODY_TOO_LARGE, f"body exceeds {max_body} bytes")
        encoding = ",".join(request.headers.get_all("content-encoding"))
        try:
            decoded = content_decode(body, encoding, 4 * max_body) if encoding else body
        except DecodeLimit as exc:
            raise Denied(Reason.BODY_TOO_LARGE, str(exc)) from None
        except DecodeError as exc:
            raise Denied(Reason.UNDECODABLE_CONTENT, str(exc)) from None
        head = "\r\n".join(
            [f"{request.method} {request.host_header or ''}{request.path}"]
            + [f"{name}: {value}" for name, value in request.headers.items(multi=True)]
        ).encode("utf-8", "surrogateescape")
        if request.trailers:
            head += b"\r\n" + b"\r\n".join(
                f"{name}: {value}".encode("utf-8", "surrogateescape")
                for name, value in request.trailers.items(multi=True)
            )
        content_type = request.headers.get("content-type", "")
        try:
            result = fstate.effective.scanner.scan_request(head, decoded, content_type, max_body)
        except ScanError as exc:
            raise Denied(Reason(exc.reason), str(exc)) from None
        fstate.scan_rule_ids = sorted(result.rule_ids)
        fstate.placeholders = set(result.placeholders)
        if result.rule_ids:
            raise Denied(Reason.SECRET_DETECTED, ",".join(sorted(result.rule_ids)))

    @guard
    def websocket_message(self, flow: http.HTTPFlow) -> None:
        assert flow.websocket is not None
        message = flow.websocket.messages[-1]
        if not message.from_client:
            return
        fstate = flow_state(flow)
        if fstate.effective is None:
            message.drop()
            flow.kill()
            return
        reason: Reason | None = None
        try:
            result = fstate.effective.scanner.scan_request(
                b"", message.content, "", self.shared.max_body
            )
        except ScanError as exc:
            reason, rule_ids = Reason(exc.reason), [exc.reason]
        else:
            host = self.shared.conns.get(flow.client_conn).connect_host or ""
            bound = {rule.secret for rule in fstate.effective.policy.injections_for(host)}
            rule_ids = sorted(result.rule_ids) + [
                f"placeholder:{ref}" for ref in sorted(result.placeholders - bound)
            ]
            if rule_ids:
                reason = Reason.SECRET_DETECTED
        if reason is not None:
            message.drop()
            self.shared.traffic.websocket_record(flow, reason, rule_ids)
            flow.kill()
