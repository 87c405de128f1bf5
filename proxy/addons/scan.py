# mypy: disable-error-code="no-untyped-call"
"""Scanning: secrets and placeholders in the request head and decoded body, and in WebSocket
messages from the client (403 `secret_detected`, 400 `undecodable_content`, 413 on limits)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from urllib.parse import parse_qsl

from mitmproxy import http

from umbra.proxy.addons.base import Denied, UmbraAddon, deny, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import FlowState, Stage, flow_state
from umbra.proxy.decode import DecodeError, DecodeLimit, content_decode
from umbra.proxy.scanner import ScanError

# Bodies larger than this are scanned off the event loop (thread hand-off costs ~50 us).
OFF_LOOP_BYTES = 64 << 10
_MAX_PAIR_FIELDS = 24
_MAX_PAIR_FIELD = 256


def request_fields(request: http.Request, body: bytes, content_type: str) -> list[bytes]:
    """The values a request carries in parts (query parameters, headers, cookies, form and JSON
    fields), in order: a secret split across two of them is found in their concatenation."""
    fields: list[bytes] = []
    query = request.path.partition("?")[2]
    fields += [value.encode("utf-8", "surrogateescape") for _, value in parse_qsl(query)]
    fields += [value.encode("utf-8", "surrogateescape") for value in request.headers.values()]
    for cookie in request.headers.get_all("cookie"):
        for part in cookie.split(";"):
            fields.append(part.partition("=")[2].strip().encode("utf-8", "surrogateescape"))
    kind = content_type.lower()
    if body and "x-www-form-urlencoded" in kind:
        text = body.decode("latin-1")
        fields += [value.encode("latin-1") for _, value in parse_qsl(text)]
    elif body and "json" in kind:
        with contextlib.suppress(ValueError, RecursionError):
            _json_strings(json.loads(body), fields)
    return fields


def _json_strings(value: object, out: list[bytes]) -> None:
    if isinstance(value, str):
        out.append(value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, dict):
        for item in value.values():
            _json_strings(item, out)
    elif isinstance(value, list):
        for item in value:
            _json_strings(item, out)


def joined_fields(fields: list[bytes], body: bytes) -> bytes:
    """Every ordered pair of short fields, concatenated (so a two-way split in any order is
    matched), plus each field followed by the start of the body (header + body)."""
    short = [field for field in fields if 0 < len(field) <= _MAX_PAIR_FIELD][:_MAX_PAIR_FIELDS]
    pairs = [a + b for a in short for b in short if a is not b]
    if body:
        pairs += [field + body[:_MAX_PAIR_FIELD] for field in short]
    return b"\n".join(pairs)


class Scan(UmbraAddon):
    @guard
    async def request(self, flow: http.HTTPFlow) -> None:
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
            if len(flow.request.raw_content or b"") > OFF_LOOP_BYTES:
                # A large body is decoded and scanned in a worker thread: every other connection
                # keeps being served meanwhile. The flow waits (mitmproxy awaits the hook).
                await asyncio.to_thread(self.scan, flow, fstate)
            else:
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
        joined = joined_fields(request_fields(request, decoded, content_type), decoded)
        try:
            result = fstate.effective.scanner.scan_request(
                head, decoded, content_type, max_body, joined
            )
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
