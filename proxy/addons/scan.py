# mypy: disable-error-code="no-untyped-call"
"""Scanning: secrets and placeholders in the request head and decoded body, and in WebSocket
messages from the client (403 `secret_detected`, 400 `undecodable_content`, 413 on limits)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from urllib.parse import parse_qsl

from mitmproxy import http

from umbra.proxy.addons.base import Denied, UmbraAddon, close_websocket, deny, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import FlowState, Stage, flow_state
from umbra.proxy.decode import DecodeError, DecodeLimit, content_decode
from umbra.proxy.mitm_compat import WS_POLICY_CLOSE
from umbra.proxy.reassembly import variants as _variants
from umbra.proxy.scanner import ScanError

# Bodies larger than this are scanned off the event loop (thread hand-off costs ~50 us).
OFF_LOOP_BYTES = 64 << 10
_MAX_PAIR_FIELDS = 24
_MAX_PAIR_FIELD = 256
# A body that looks like a form is read as one whatever its content type.
_FORM = re.compile(rb"[A-Za-z0-9._~%+*\-]+=[^&\s]*(?:&[A-Za-z0-9._~%+*\-]+=[^&\s]*)*")
_FORM_SNIFF = 64 << 10


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
    # The body's fields whatever the content type says: the origin parses what it receives.
    kind = content_type.lower()
    head = body[:64].lstrip()[:1]
    if body and ("json" in kind or head in (b"{", b"[")):
        with contextlib.suppress(ValueError, RecursionError):
            _json_strings(json.loads(body), fields)
    if body and ("x-www-form-urlencoded" in kind or _FORM.fullmatch(body[:_FORM_SNIFF])):
        text = body.decode("latin-1")
        fields += [value.encode("latin-1") for _, value in parse_qsl(text)]
    if 0 < len(body) <= _MAX_PAIR_FIELD:
        fields.append(body)  # a short body is one more field (and decoded like one)
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
    """One request's headers, query and body as one text for split secrets: every ordered pair
    of short fields, each also decoded as the scanner would (base64, hex, URL), concatenated (so a
    two-way split in any order and any mix of encodings is matched), plus each field followed by
    the start of the body and preceded by its end (header + body, body + header)."""
    short = [field for field in fields if 0 < len(field) <= _MAX_PAIR_FIELD][:_MAX_PAIR_FIELDS]
    forms: list[bytes] = []
    for field in short:
        for form in _variants(field):
            if form and form not in forms and len(forms) < 2 * _MAX_PAIR_FIELDS:
                forms.append(form)
    pairs = [a + b for a in forms for b in forms if a is not b]
    if body:
        start, end = body[:_MAX_PAIR_FIELD], body[-_MAX_PAIR_FIELD:]
        pairs += [form + start for form in forms] + [end + form for form in forms]
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
                head,
                decoded,
                content_type,
                max_body,
                joined,
                ",".join(request.headers.get_all("grpc-encoding")),
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
            close_websocket(self.shared, flow, Reason.NOT_DECIDED, "", WS_POLICY_CLOSE)
            return
        reason: Reason | None = None
        try:
            result = fstate.effective.scanner.scan_request(
                b"", message.content, "", self.shared.max_body
            )
        except ScanError as exc:
            reason, rule_ids = Reason(exc.reason), [exc.reason]
        else:
            conn = self.shared.conns.get(flow.client_conn)
            injections = fstate.effective.policy.injections_for(
                conn.connect_host or "", conn.connect_port or 0
            )
            bound = {ref for rule in injections for ref in rule.refs}
            rule_ids = sorted(result.rule_ids) + [
                f"placeholder:{ref}" for ref in sorted(result.placeholders - bound)
            ]
            if rule_ids:
                reason = Reason.SECRET_DETECTED
        if reason is not None:
            close_websocket(self.shared, flow, reason, "", WS_POLICY_CLOSE, rule_ids)
