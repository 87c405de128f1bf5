"""Umbra's mitmproxy addons: one concern each, added in the order of the checks.

Order for an HTTP request (each failure answers and logs; nothing is forwarded): identity (407) ->
request sanity and name agreement (400/405/413/421) -> policy decision (403) -> budgets (429)
-> git push refs and request fields / MCP tools (403/400/413, JSON-RPC errors) -> scan
(403/400/413) -> minting (403/503) -> injection (403) -> SigV4 re-signing (403/400) -> upstream
handshake (ALPN, SNI) -> dial guard (502). Responses pass the response guard (reflection, 502/cut),
then the MCP tool-list and LLM usage taps beside the stream.
The traffic log comes last: it logs what finished; every record is constructed there.

`build_addons` is the one registry; mitmproxy sees them as one addon (`chain.Chain`), which runs
them in this order.
"""

from __future__ import annotations

from umbra.proxy.addons.base import AddonConfig, Denied, Shared
from umbra.proxy.addons.budget import Budgets
from umbra.proxy.addons.dial import DialGuard
from umbra.proxy.addons.fields import RequestFields
from umbra.proxy.addons.git import GitPush
from umbra.proxy.addons.handshake import Handshake
from umbra.proxy.addons.identity import Identity
from umbra.proxy.addons.inject import Inject
from umbra.proxy.addons.layers import Layers
from umbra.proxy.addons.mcp import McpTools
from umbra.proxy.addons.mint import Mint
from umbra.proxy.addons.policy import PolicyDecision
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.response_guard import ResponseGuard
from umbra.proxy.addons.sanity import RequestSanity
from umbra.proxy.addons.scan import Scan
from umbra.proxy.addons.sigv4 import Sigv4
from umbra.proxy.addons.usage import LlmUsage

__all__ = ["AddonConfig", "Denied", "Reason", "Shared", "build_addons"]


def build_addons(shared: Shared) -> list[object]:
    return [
        Identity(shared),
        Layers(shared),
        RequestSanity(shared),
        PolicyDecision(shared),
        Budgets(shared, shared.budget_file),
        GitPush(shared),
        RequestFields(shared),
        Scan(shared),
        Mint(shared),
        Inject(shared),
        Sigv4(shared),
        ResponseGuard(shared),
        McpTools(shared, shared.mcp_tools_file),
        LlmUsage(shared),
        Handshake(shared),
        DialGuard(shared),
        shared.traffic,
    ]
