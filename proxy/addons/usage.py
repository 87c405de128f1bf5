"""LLM usage accounting: the usage an Anthropic- or OpenAI-shaped API reports in an allowed
response (JSON or an event stream) goes into that exchange's record (`llm_model`,
`llm_*_tokens`). The response streams as before: a tap beside the stream reads it
(`proxy/usage.py`) and holds nothing back. Usage that is not believable (negative, huge, not a
number) is not summed: it gets a record of its own, reason `usage_invalid`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from mitmproxy import http

from umbra.proxy.addons.base import UmbraAddon, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.records import side_record
from umbra.proxy.addons.state import FlowState, Stage, flow_state
from umbra.proxy.usage import UsageReader, provider_of

logger = logging.getLogger("umbra.proxy")


class LlmUsage(UmbraAddon):
    enabled = True  # benchmarks/proxy_usage_bench.py measures the proxy with it off

    @guard
    def request(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        if not self.enabled or fstate.denied or flow.request.method != "POST":
            return
        decision = fstate.decision
        if decision is None or not decision.allowed:
            return
        if provider_of(decision.path or flow.request.path) is not None:
            fstate.llm_usage_wanted = True
            # an encoded answer could not be read beside the stream: ask for the identity
            flow.request.headers["accept-encoding"] = "identity"

    @guard
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        fstate = flow_state(flow)
        response = flow.response
        if response is None or not fstate.llm_usage_wanted or fstate.stage is not Stage.ALLOWED:
            return
        inner = response.stream
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if not callable(inner) or encoding != "identity":
            return
        content_type = response.headers.get("content-type", "").lower()
        if "json" not in content_type and "event-stream" not in content_type:
            return
        reader = UsageReader(event_stream="event-stream" in content_type)
        response.stream = self._tap(flow, fstate, inner, reader)

    def _tap(
        self,
        flow: http.HTTPFlow,
        fstate: FlowState,
        inner: Callable[[bytes], Iterable[bytes] | bytes],
        reader: UsageReader,
    ) -> Callable[[bytes], bytes]:
        def tap(chunk: bytes) -> bytes:
            result = inner(chunk)
            out = result if isinstance(result, bytes) else b"".join(result)
            try:
                if chunk:
                    reader.feed(out)
                else:
                    reader.finish()
                    self._done(flow, fstate, reader)
            except Exception as exc:  # the tap observes; a fault must not cut the stream
                logger.error("LLM usage reading failed (%s)", type(exc).__name__)
            return out

        return tap

    def _done(self, flow: http.HTTPFlow, fstate: FlowState, reader: UsageReader) -> None:
        if reader.invalid is not None:
            side_record(self.shared, flow, fstate, Reason.USAGE_INVALID, reader.invalid)
            return
        fstate.llm_usage = reader.record_fields()
