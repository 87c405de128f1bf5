"""The traffic-log addon: the one place the proxy constructs traffic-log records.

Other addons report decisions through `flow_record`, `connection_record` and `websocket_record`;
the hooks here log what finished (`response`, `error`). Every record is redacted before it is
written: values of every secret the proxy holds *now* (the set changes as the Console releases
secrets), every match of the policy's scan rules, and names (path, query keys) of a flow whose
request the scanner flagged.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from mitmproxy import connection, http

from umbra.contracts.traffic import Decision, Kind, TrafficRecord
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import ConnTable, FlowState, Stage, flow_state
from umbra.proxy.mitm_compat import WS_CONTROL, ControlKind
from umbra.proxy.secrets import SecretStore
from umbra.proxy.spool import Spool
from umbra.proxy.state import PolicyState
from umbra.proxy.trafficlog import REDACTED, Redactor

logger = logging.getLogger(__name__)

# Fields that are the proxy's own words, never sandbox text: not worth a pattern pass.
_OWN_FIELDS = frozenset({"id", "time", "decision", "reason", "kind", "status", "policy_hash"})


class TrafficLog:
    def __init__(self, state: PolicyState, conns: ConnTable, spool: Spool | None) -> None:
        self._state = state
        self._conns = conns
        self._spool = spool
        self._secrets: SecretStore | None = None
        self._redactor = Redactor([])
        self._patterns: dict[str, list[re.Pattern[str]]] = {}
        self.records = 0

    # ---------------------------------------------------------------- redaction

    def _current_redactor(self) -> Redactor:
        secrets = self._state.secrets
        if secrets is not self._secrets:
            # Secrets released after start-up must be redacted too: rebuild on every swap.
            self._redactor = Redactor([(item.ref, item.value) for item in secrets.all_values()])
            self._secrets = secrets
        return self._redactor

    def _rule_patterns(self, fstate: FlowState | None) -> list[re.Pattern[str]]:
        if fstate is None or fstate.effective is None:
            return []
        policy = fstate.effective.policy
        patterns = self._patterns.get(policy.hash)
        if patterns is None:
            patterns = []
            for rule in policy.scan_rules:
                try:
                    patterns.append(re.compile(rule.regex.replace(r"\b", "")))
                except re.error:
                    continue
            if len(self._patterns) > 64:
                self._patterns.clear()
            self._patterns[policy.hash] = patterns
        return patterns

    def clean(self, text: str, fstate: FlowState | None) -> str:
        """Text for the sandbox (a denial's body), redacted like a record's fields."""
        return self._current_redactor().clean(_sub_all(self._rule_patterns(fstate), text))

    def _redact(self, fields: dict[str, Any], fstate: FlowState | None) -> None:
        """Redact the observed fields in place, before the record is built from them (so a cut
        to the schema's limits can never leave part of a secret behind)."""
        if fstate is not None and (fstate.scan_rule_ids or fstate.detected):
            # The scanner saw a secret somewhere in this request, perhaps encoded: names that came
            # from the request are not worth the risk.
            if fields.get("path"):
                fields["path"] = REDACTED
            if fields.get("query_keys"):
                fields["query_keys"] = [REDACTED]
        patterns = self._rule_patterns(fstate) if fields["decision"] != Decision.ALLOW else []
        redactor = self._current_redactor()
        for key, value in fields.items():
            if key in _OWN_FIELDS:
                continue
            if isinstance(value, str):
                fields[key] = redactor.clean(_sub_all(patterns, value))
            elif isinstance(value, list):
                fields[key] = [
                    redactor.clean(_sub_all(patterns, item)) if isinstance(item, str) else item
                    for item in value
                ]

    def emit(self, fields: dict[str, Any], fstate: FlowState | None = None) -> None:
        """Redact, then build the contract record once (`TrafficRecord.build` never fails for
        sandbox-controlled text) and spool it."""
        self.records += 1
        if fields["decision"] != Decision.ALLOW and fields.get("reason") in (
            Reason.INTERNAL_ERROR,
            Reason.POLICY_UNAVAILABLE,
        ):
            logger.error("denied (%s): %s", fields["reason"], str(fields.get("detail"))[:200])
        if self._spool is not None:
            self._redact(fields, fstate)
            self._spool.append(TrafficRecord.build(**fields))

    # ---------------------------------------------------------------- construction

    def base(self, client: connection.Client) -> dict[str, Any]:
        state = self._conns.get(client)
        identity = state.identity
        return {
            "cvm_id": identity.cvm_id if identity else None,
            "owner": identity.owner if identity else None,
            "team": identity.team if identity else None,
            "connect_host": state.connect_raw,
            "sni": client.sni,
            "port": state.connect_port,
        }

    def flow_record(
        self,
        flow: http.HTTPFlow,
        decision: Decision | str,
        reason: Reason,
        detail: str = "",
        **extra: Any,
    ) -> None:
        fstate = flow_state(flow)
        if fstate.logged:
            return
        fstate.logged = True
        fields = self.base(flow.client_conn)
        conn = self._conns.get(flow.client_conn)
        fields.update(
            kind=Kind.HTTP,
            method=flow.request.method,
            host=flow.request.host_header,
            policy_hash=fstate.effective.policy.hash if fstate.effective else None,
            query_keys=fstate.query_keys,
            decision=Decision(decision),
            reason=str(reason),
            detail=detail[:300],
            status=reason.status,
            scan_rule_ids=sorted(fstate.scan_rule_ids),
            injected_headers=fstate.injected_headers,
            bytes_sent=len(flow.request.raw_content or b""),
            duration_ms=round((time.monotonic() - fstate.started) * 1000, 3),
        )
        if conn.connect_raw is None:
            fields["connect_host"] = flow.request.host
            fields["port"] = flow.request.port
        if fstate.decision is not None:
            fields["path"] = fstate.decision.path
            fields["rule_id"] = fstate.decision.rule_id
        if flow.server_conn.peername:
            fields["pinned_ip"] = str(flow.server_conn.peername[0])
        fields.update(extra)
        self.emit(fields, fstate)

    def connection_record(
        self,
        client: connection.Client,
        host: str,
        port: int,
        reason: str,
        detail: str,
        pinned: str | None = None,
    ) -> None:
        fields = self.base(client)
        fields.update(
            kind=Kind.CONNECTION,
            connect_host=fields["connect_host"] or host,
            port=port,
            decision=Decision.DENY,
            reason=reason,
            detail=detail[:300],
            status=502,
            pinned_ip=pinned,
        )
        self.emit(fields)

    def websocket_record(
        self,
        flow: http.HTTPFlow,
        reason: Reason | str,
        rule_ids: list[str],
        detail: str = "",
        *,
        decision: Decision = Decision.DENY,
        **extra: Any,
    ) -> None:
        fstate = flow_state(flow)
        fields = self.base(flow.client_conn)
        fields.update(
            kind=Kind.WEBSOCKET,
            method="WS",
            decision=decision,
            reason=str(reason),
            detail=detail[:300],
            scan_rule_ids=rule_ids,
            policy_hash=fstate.effective.policy.hash if fstate.effective else None,
            host=flow.request.host_header,
        )
        if fstate.decision is not None:
            fields["path"] = fstate.decision.path
            fields["rule_id"] = fstate.decision.rule_id
        fields.update(extra)
        self.emit(fields, fstate)

    # ---------------------------------------------------------------- hooks

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT" or flow.response is None:
            return
        fstate = flow_state(flow)
        if fstate.stage is not Stage.ALLOWED or fstate.logged:
            return
        size = fstate.response_bytes or len(flow.response.raw_content or b"")
        self.flow_record(
            flow,
            Decision.ALLOW,
            Reason.RULE_ALLOW,
            fstate.note,
            status=flow.response.status_code,
            bytes_received=size,
            **fstate.llm_usage,
        )

    def websocket_start(self, flow: http.HTTPFlow) -> None:
        # mitmproxy relays control frames without a hook; mitm_compat answers pings hop by hop,
        # drops pongs and reports each payload it did not relay here, so the channel is visible in
        # the log, not only closed.
        # A keep-alive pings every few seconds for hours: the first frame of each kind and side is
        # recorded at once, the rest are counted into one summary record at the end (the log stays
        # bounded per connection, however many frames a client sends).
        later = flow_state(flow).ws_control_later

        def control(kind: ControlKind, from_client: bool, size: int) -> None:
            counted = later.get((kind, from_client))
            if counted is None:
                later[(kind, from_client)] = [0, 0]
                self._control_record(flow, kind, from_client, size)
            else:
                counted[0] += 1
                counted[1] += size

        flow.metadata[WS_CONTROL] = control

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        for (kind, from_client), (count, size) in flow_state(flow).ws_control_later.items():
            if count:
                self._control_record(flow, kind, from_client, size, more=count)
        reason = flow.websocket.close_reason if flow.websocket is not None else None
        if reason and flow.websocket is not None:
            size = len(reason.encode())
            code = flow.websocket.close_code
            self._control_record(
                flow, f"close (code {code})", flow.websocket.closed_by_client is True, size
            )

    def _control_record(
        self, flow: http.HTTPFlow, kind: str, from_client: bool, size: int, more: int = 0
    ) -> None:
        side = "client" if from_client else "server"
        what = _CONTROL_FATE.get(kind, "reason emptied")
        frames = f"{more} more {kind} frames" if more else kind
        self.websocket_record(
            flow,
            Reason.WS_CONTROL_NOT_RELAYED,
            [],
            f"{frames} from {side}: {size}-byte {what}",
            bytes_sent=size if from_client else 0,
            bytes_received=0 if from_client else size,
        )

    def error(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        if fstate.logged:
            return
        message = flow.error.msg if flow.error else "error"
        reason = error_reason(message, flow)
        # The decision stays what policy decided (an allowed exchange that broke is `allow` with
        # the error as its reason); the schema knows no third decision.
        allowed = fstate.stage is Stage.ALLOWED and reason is not Reason.UPSTREAM_REFUSED
        decision = Decision.ALLOW if allowed else Decision.DENY
        self.flow_record(flow, decision, reason, message[:200])


# What became of a control frame's payload instead of being relayed (close: the reason is emptied).
_CONTROL_FATE: dict[str, str] = {
    ControlKind.PING: "payload answered by the proxy, not relayed",
    ControlKind.PONG: "payload dropped, not relayed",
}


def _sub_all(patterns: list[re.Pattern[str]], value: str) -> str:
    for pattern in patterns:
        value = pattern.sub(REDACTED, value)
    return value


def error_reason(message: str, flow: http.HTTPFlow) -> Reason:
    """Classify mitmproxy's flow error: which side broke the exchange.

    mitmproxy's error hook does not say which side failed, only the message; the side is read from
    the flow instead: a request the client never finished is the client's doing, whatever the
    message says (a bad chunk, a body cut short, a reset stream)."""
    lowered = message.lower()
    if "body_size_limit" in message:
        return Reason.BODY_TOO_LARGE
    if message.startswith("Connection killed"):
        return Reason.UPSTREAM_REFUSED  # server_connect refused the dial (logged with why)
    if "killed" in lowered:
        return Reason.KILLED
    if "smuggling" in lowered:
        return Reason.INVALID_REQUEST
    if flow.response is None and flow.request.timestamp_end is None:
        if _HEAD_REJECTED.search(message) and not message.startswith("HTTP/1 protocol error"):
            # mitmproxy's own validation refused the request head (framing headers).
            return Reason.INVALID_REQUEST
        return Reason.CLIENT_ERROR
    if "client" in lowered:
        return Reason.CLIENT_ERROR  # e.g. the client went away while the response was coming
    return Reason.UPSTREAM_ERROR


# The messages of mitmproxy's request-head validation (`http1.expected_http_body_size`).
_HEAD_REJECTED = re.compile(
    r"(?i)transfer-encoding|content-length|invalid (?:request|http|header)|unsupported"
)
