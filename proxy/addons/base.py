# mypy: disable-error-code="no-untyped-call"
"""What every Umbra addon shares: its dependencies, the denial, and the fail-closed guard.

mitmproxy logs and continues when an addon hook raises, so every hook runs inside `guard`, which
turns any exception into a denial of that flow or a poisoned connection, and says so on the proxy's
own log (the exception type only: a message could quote request bytes).
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mitmproxy import connection, http, tcp, tls, udp
from mitmproxy.proxy import layer, server_hooks

from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import ConnTable, Stage, flow_state
from umbra.proxy.addons.traffic import TrafficLog
from umbra.proxy.denial import Advisor, Refused, render
from umbra.proxy.identity import IdentitySource
from umbra.proxy.mcp_sse import SseEndpoints
from umbra.proxy.minting import Minter
from umbra.proxy.mitm_compat import CLOSE_WS, WS_INTERNAL_ERROR
from umbra.proxy.netcheck import AddressPolicy
from umbra.proxy.resolver import Resolver
from umbra.proxy.spool import Spool
from umbra.proxy.state import PolicyState

logger = logging.getLogger("umbra.proxy")


@dataclass(frozen=True)
class AddonConfig:
    state: PolicyState
    identities: IdentitySource
    resolver: Resolver
    addresses: AddressPolicy
    spool: Spool | None
    max_body: int
    minter: Minter | None = None  # mints access tokens for OAuth kinds (addons/mint.py)
    # the time budget windows read (addons/budget.py); tests move it (--test-clock)
    clock: Callable[[], float] = time.time


class Shared:
    """One instance per proxy, handed to every addon."""

    def __init__(self, config: AddonConfig) -> None:
        self.state = config.state
        self.identities = config.identities
        self.resolver = config.resolver
        # Replaced once the listener is up (own sockets become known then).
        self.addresses = config.addresses
        self.max_body = config.max_body
        self.minter = config.minter
        self.clock = config.clock
        self.conns = ConnTable()
        self.traffic = TrafficLog(config.state, self.conns, config.spool)
        self.advisor = Advisor()
        # Budget counters are saved beside the traffic log (addons/budget.py).
        self.budget_file = config.spool.directory / "budgets.json" if config.spool else None
        # MCP HTTP+SSE endpoints announced on the event streams relayed (proxy/mcp_sse.py).
        self.mcp_sse = SseEndpoints()
        # MCP tool-list baselines beside them (addons/mcp.py).
        self.mcp_tools_file = config.spool.directory / "mcp-tools.json" if config.spool else None


class Denied(Exception):
    def __init__(
        self,
        reason: Reason,
        detail: str = "",
        rule_id: str | None = None,
        secret: str | None = None,
    ) -> None:
        self.reason, self.detail, self.rule_id = reason, detail, rule_id
        self.secret = secret  # the reference (team/NAME) of a secret that is not set, never a value
        super().__init__(f"{reason}: {detail}")

    @property
    def status(self) -> int:
        return self.reason.status or 403


def deny(shared: Shared, flow: http.HTTPFlow, denial: Denied) -> None:
    """Answer the flow with the denial and log it; later addons see the flow as denied."""
    headers = {"x-umbra-reason": str(denial.reason)}
    if denial.status == 407:
        headers["proxy-authenticate"] = 'Basic realm="umbra"'
    fstate = flow_state(flow)
    try:
        body, content_type = _explain(shared, flow, denial)
    except Exception as exc:  # the answer must still go out, and still say why
        logger.error("denial text failed (%s)", type(exc).__name__)
        body, content_type = f"umbra: denied ({denial.reason})\n".encode(), "text/plain"
    headers["content-type"] = content_type
    flow.response = http.Response.make(denial.status, body, headers)
    fstate.stage = Stage.DENIED
    shared.traffic.flow_record(
        flow,
        "deny",
        denial.reason,
        denial.detail,
        status=denial.status,
        **({"rule_id": denial.rule_id} if denial.rule_id else {}),
    )


def close_websocket(
    shared: Shared,
    flow: http.HTTPFlow,
    reason: Reason,
    detail: str,
    code: int,
    rule_ids: list[str] | None = None,
) -> None:
    """Drop the message in hand, close both sides (mitm_compat does it after the hook) and write
    one record for the connection; never `flow.kill()`, which a WebSocket flow may refuse."""
    websocket = flow.websocket
    if websocket is not None and websocket.messages:
        websocket.messages[-1].drop()
    flow.metadata.setdefault(CLOSE_WS, code)
    fstate = flow_state(flow)
    if not fstate.ws_closed:
        fstate.ws_closed = True
        shared.traffic.websocket_record(
            flow, reason, [str(reason)] if rule_ids is None else rule_ids, detail
        )


def _explain(shared: Shared, flow: http.HTTPFlow, denial: Denied) -> tuple[bytes, str]:
    """The denial's body (`proxy/denial.py`): one sentence first, redacted like a record."""
    fstate = flow_state(flow)
    state = shared.conns.get(flow.client_conn)
    request = flow.request
    identity = state.identity
    profiles = tuple(sorted(identity.profiles)) if identity is not None else ()
    decision = fstate.decision
    host = (decision.host if decision is not None else None) or state.connect_host
    host = (host or request.host or "?")[:100]
    port = state.connect_port or request.port
    path = (decision.path if decision is not None else None) or request.path.partition("?")[0]
    scheme = "https" if flow.client_conn.tls_established else request.scheme
    method = request.method[:20]
    candidates: tuple[str, ...] = ()
    if denial.reason in (Reason.NO_MATCHING_RULE, Reason.NO_POLICY):
        source = shared.state.source
        available = (
            source.bundle.profile_names()
            if source.bundle is not None
            else sorted(source.policy_set.profiles)
            if source.policy_set is not None
            else []
        )
        candidates = shared.advisor.candidates(
            source.generation,
            available,
            source.compose,
            profiles,
            (method, scheme, host, port, path),
        )
    refused = Refused(
        method, scheme, host, port, path, denial.reason, denial.detail[:200], denial.rule_id,
        profiles, candidates, denial.secret,
    )  # fmt: skip
    wants_json = "json" in request.headers.get("accept", "").lower()
    return render(refused, wants_json, lambda text: shared.traffic.clean(text, fstate))


class UmbraAddon:
    """Base of every Umbra addon: holds the shared dependencies."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared


def guard[F: Callable[..., Any]](method: F) -> F:
    """Run a hook fail-closed: an exception denies the flow or poisons the connection.

    A synchronous hook stays synchronous (no coroutine per call: most hooks never wait)."""

    def failed(self: UmbraAddon, target: Any, exc: Exception) -> None:
        logger.error(
            "hook %s.%s failed (%s); failing closed",
            type(self).__name__,
            method.__name__,
            type(exc).__name__,
        )
        fail_closed(self.shared, target, method.__name__, exc)

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def run_async(self: UmbraAddon, target: Any) -> None:
            try:
                await method(self, target)
            except Exception as exc:
                failed(self, target, exc)

        return run_async  # type: ignore[return-value]

    @functools.wraps(method)
    def run(self: UmbraAddon, target: Any) -> None:
        try:
            method(self, target)
        except Exception as exc:
            failed(self, target, exc)

    return run  # type: ignore[return-value]


_WS_HOOKS = frozenset({"websocket_start", "websocket_message", "websocket_end"})


def fail_closed(shared: Shared, target: Any, hook: str, exc: Exception) -> None:
    detail = f"internal error in {hook} ({type(exc).__name__})"
    try:
        if isinstance(target, http.HTTPFlow) and hook in _WS_HOOKS:
            close_websocket(shared, target, Reason.INTERNAL_ERROR, detail, WS_INTERNAL_ERROR)
        elif isinstance(target, http.HTTPFlow):
            fstate = flow_state(target)
            if hook in ("responseheaders", "response"):
                target.response = http.Response.make(
                    502, b"umbra: denied (internal error)\n", {"content-type": "text/plain"}
                )
                target.kill()
                fstate.stage = Stage.DENIED
                shared.traffic.flow_record(
                    target, "deny", Reason.INTERNAL_ERROR, detail, status=502
                )
            else:
                if not fstate.denied:
                    deny(shared, target, Denied(Reason.INTERNAL_ERROR, detail))
        elif isinstance(target, tcp.TCPFlow):
            shared.conns.get(target.client_conn).poisoned = detail
            target.kill()
            # The TCP layer relays regardless of kill() inside tcp_start: close both ends.
            target.client_conn.error = detail
        elif isinstance(target, udp.UDPFlow):
            target.kill()
        elif isinstance(target, server_hooks.ServerConnectionHookData):
            target.server.error = detail
            shared.conns.get(target.client).poisoned = detail
        elif isinstance(target, connection.Client):
            target.error = detail
            shared.conns.get(target).poisoned = detail
        elif isinstance(target, (tls.ClientHelloData, layer.NextLayer)):
            shared.conns.get(target.context.client).poisoned = detail
    except Exception:
        logger.error("fail-closed handler failed in %s; killing", hook)
        kill = getattr(target, "kill", None)
        if callable(kill):
            kill()
