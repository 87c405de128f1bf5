"""Per-connection and per-flow state: one home each.

Connection state lives in a table keyed by client id and is dropped in `client_disconnected` (the
identity addon's). Flow state lives on the flow itself (`flow.metadata`), so it ends with the flow
and nothing has to be popped by hand.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from mitmproxy import connection, http, tcp

from umbra.policy import Decision
from umbra.policy.compiled import CompiledBudget
from umbra.proxy.identity import CvmIdentity
from umbra.proxy.reassembly import Reassembler
from umbra.proxy.state import Effective

_FLOW_KEY = "umbra.flow"


@dataclass
class ConnState:
    """What the proxy knows about one client connection (one sandbox TCP connection)."""

    identity: CvmIdentity | None = None
    connect_host: str | None = None
    connect_port: int | None = None
    connect_raw: str | None = None
    tunnel_rule: str | None = None
    poisoned: str | None = None
    authorized: set[tuple[str, int]] = field(default_factory=set)
    pinned: dict[tuple[str, int], str] = field(default_factory=dict)
    pinned_names: dict[tuple[str, int], str] = field(default_factory=dict)


class Stage(Enum):
    """How far a flow got; each stage is set by the addon that owns it."""

    NEW = "new"
    GATED = "gated"  # identity, sanity, names and policy passed (requestheaders)
    ALLOWED = "allowed"  # scanned and injected: forwarded (request)
    DENIED = "denied"


@dataclass
class FlowState:
    stage: Stage = Stage.NEW
    logged: bool = False
    effective: Effective | None = None
    decision: Decision | None = None
    started: float = field(default_factory=time.monotonic)
    scan_rule_ids: list[str] = field(default_factory=list)
    # Every secret-looking match the scanner found in this flow: redacted from its record.
    detected: list[bytes] = field(default_factory=list)
    placeholders: set[str] = field(default_factory=set)
    injected_headers: list[str] = field(default_factory=list)
    injected_values: list[str] = field(default_factory=list)
    query_keys: list[str] = field(default_factory=list)
    # What the proxy read from an allowed request worth its record (e.g. the refs a push changes).
    note: str = ""
    # The request asks an MCP server for its tools (addons/mcp.py compares the answer).
    mcp_tools_list: bool = False
    mcp_event_stream: bool = False  # a GET that may be an MCP HTTP+SSE event stream
    mcp_refusal: str | None = None  # a refusal answered on the event stream (proxy/mcp_sse.py)
    # The request is an LLM API call whose response usage is read (addons/usage.py), and what
    # was read: record fields (`llm_model`, `llm_*_tokens`).
    llm_usage_wanted: bool = False
    llm_usage: dict[str, object] = field(default_factory=dict)
    # The budgets that admitted this request and its subjects (cvm, owner), until it is charged.
    budgets: tuple[tuple[CompiledBudget, ...], dict[str, str]] | None = None
    stream_response: bool = False
    response_bytes: int = 0
    # WebSocket control frames seen after the first of their (kind, from client): [count, bytes],
    # recorded as one summary when the connection ends.
    ws_control_later: dict[tuple[str, bool], list[int]] = field(default_factory=dict)
    # The WebSocket connection was closed by the proxy (its one record is written).
    ws_closed: bool = False
    # Server messages of a WebSocket that carried an injected credential, checked as one sequence.
    ws_reassembler: Reassembler | None = None
    # Server messages held while they may start a credential, and how many released ones (sent
    # again by the proxy) are still to pass the guard unchecked.
    ws_held: list[tuple[bytes, bool]] = field(default_factory=list)
    ws_releasing: int = 0

    @property
    def denied(self) -> bool:
        return self.stage is Stage.DENIED


def flow_state(flow: http.HTTPFlow | tcp.TCPFlow) -> FlowState:
    state = flow.metadata.get(_FLOW_KEY)
    if not isinstance(state, FlowState):
        state = flow.metadata[_FLOW_KEY] = FlowState()
    return state


class ConnTable:
    def __init__(self) -> None:
        self._conns: dict[str, ConnState] = {}

    def get(self, client: connection.Client) -> ConnState:
        state = self._conns.get(client.id)
        if state is None:
            state = self._conns[client.id] = ConnState()
        return state

    def peek(self, client: connection.Client) -> ConnState | None:
        return self._conns.get(client.id)

    def drop(self, client: connection.Client) -> None:
        self._conns.pop(client.id, None)

    def __len__(self) -> int:
        return len(self._conns)
