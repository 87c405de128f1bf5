# mypy: disable-error-code="no-untyped-call"
"""The mitmproxy addon that enforces Umbra policy on every flow.

Order of checks for an HTTP request (each failure answers and logs, nothing is forwarded):
identity (407) -> method/upgrade/framing sanity (400/405) -> the three names agree (421) ->
policy decision on the connect target (403) -> body size (413) -> secret and placeholder scan of
URL, headers and decoded body (403/400/413) -> credential injection for the connect target only ->
upstream dial of a resolved and checked address (502). Responses to requests that carried an
injected credential are checked for that credential before they are passed back (502).

mitmproxy continues a flow when a hook raises, so every hook here runs inside `_guard`, which turns
any exception into a denial of that flow or connection.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from mitmproxy import connection, http, tcp, tls, udp
from mitmproxy.proxy import layer, layers, server_hooks
from mitmproxy.proxy.layers.http import HTTPMode

from umbra.proxy.decode import DecodeError, DecodeLimit, content_decode
from umbra.proxy.identity import CvmIdentity, IdentitySource
from umbra.proxy.inject import InjectionError, apply_injections, render_injections
from umbra.proxy.mitm_compat import STREAM_RESPONSE
from umbra.proxy.netcheck import AddressPolicy, AddressVerdict, IPAddress, parse_ip
from umbra.proxy.policy import Decision, NormalizationError, normalize_host
from umbra.proxy.policy.model import METHODS
from umbra.proxy.resolver import ResolutionError, Resolver
from umbra.proxy.scanner import ScanError, secret_encodings
from umbra.proxy.spool import Spool
from umbra.proxy.state import Effective, PolicyState
from umbra.proxy.trafficlog import Redactor, TrafficRecord

logger = logging.getLogger(__name__)

_ALLOWED_METHODS = frozenset(METHODS)
_MAX_QUERY_KEYS = 64
_STRIP_REQUEST = ("proxy-authorization", "proxy-connection")
_DECIDED = "umbra.decided"
_LOGGED = "umbra.logged"
_FAULT_PREFIX = "fault-"


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


@dataclass
class FlowState:
    effective: Effective | None = None
    decision: Decision | None = None
    started: float = field(default_factory=time.monotonic)
    scan_rule_ids: list[str] = field(default_factory=list)
    injected_headers: list[str] = field(default_factory=list)
    injected_values: list[str] = field(default_factory=list)
    query_keys: list[str] = field(default_factory=list)
    response_bytes: int = 0


@dataclass(frozen=True)
class AddonConfig:
    state: PolicyState
    identities: IdentitySource
    resolver: Resolver
    addresses: AddressPolicy
    spool: Spool | None
    max_body: int
    test_faults: bool = False


class Denied(Exception):
    def __init__(self, status: int, reason: str, detail: str = "", rule_id: str | None = None):
        self.status, self.reason, self.detail, self.rule_id = status, reason, detail, rule_id
        super().__init__(f"{reason}: {detail}")


F = TypeVar("F", bound=Callable[..., Any])


def _guard(kind: str) -> Callable[[F], F]:
    """Run a hook fail-closed: an exception denies the flow or poisons the connection."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        async def run(self: UmbraAddon, target: Any) -> None:
            try:
                self._maybe_fault(method.__name__, target)
                result = method(self, target)
                if isinstance(result, Coroutine):
                    await result
            except Exception as exc:
                logger.error("hook %s failed (%s); denying", method.__name__, type(exc).__name__)
                self._fail_closed(kind, target, method.__name__, exc)

        return run  # type: ignore[return-value]

    return wrap


class UmbraAddon:
    def __init__(self, config: AddonConfig) -> None:
        self.config = config
        self._conns: dict[str, ConnState] = {}
        self._flows: dict[str, FlowState] = {}
        self._redactor = Redactor(
            [(item.ref, item.value) for item in config.state.secrets.all_values()]
        )
        self.records = 0

    # ---------------------------------------------------------------- plumbing

    def _conn(self, client: connection.Client) -> ConnState:
        state = self._conns.get(client.id)
        if state is None:
            state = self._conns[client.id] = ConnState()
        return state

    def _flow(self, flow: http.HTTPFlow | tcp.TCPFlow) -> FlowState:
        state = self._flows.get(flow.id)
        if state is None:
            state = self._flows[flow.id] = FlowState()
        return state

    def _maybe_fault(self, hook: str, target: Any) -> None:
        """Test-only: raise inside `hook` when the connect target is named `fault-<hook>.*`."""
        if not self.config.test_faults:
            return
        client = getattr(target, "client_conn", None) or getattr(target, "client", None)
        if client is None and hasattr(target, "context"):
            client = target.context.client
        state = self._conns.get(client.id) if client is not None else None
        host = state.connect_host if state and state.connect_host else ""
        if isinstance(target, http.HTTPFlow) and not host:
            host = target.request.pretty_host
        if host.startswith(f"{_FAULT_PREFIX}{hook}."):
            raise RuntimeError(f"test fault in {hook}")

    def _fail_closed(self, kind: str, target: Any, hook: str, exc: Exception) -> None:
        detail = f"internal error in {hook} ({type(exc).__name__})"
        try:
            if isinstance(target, http.HTTPFlow):
                if hook in ("responseheaders", "response"):
                    target.response = http.Response.make(
                        502, b"umbra: denied (internal error)\n", {"content-type": "text/plain"}
                    )
                    target.kill()
                else:
                    self._deny(target, Denied(500, "internal_error", detail))
                    target.metadata[_DECIDED] = "deny"
                if not target.metadata.get(_LOGGED):
                    self._log_flow(target, "deny", "internal_error", detail, status=500)
            elif isinstance(target, (tcp.TCPFlow, udp.UDPFlow)):
                target.kill()
            elif isinstance(target, server_hooks.ServerConnectionHookData):
                target.server.error = detail
                self._conn(target.client).poisoned = detail
            elif isinstance(target, connection.Client):
                target.error = detail
                self._conn(target).poisoned = detail
            elif isinstance(target, (tls.ClientHelloData, layer.NextLayer)):
                self._conn(target.context.client).poisoned = detail
        except Exception:
            logger.error("fail-closed handler failed in %s; killing", hook)
            kill = getattr(target, "kill", None)
            if callable(kill):
                kill()

    def _emit(self, record: TrafficRecord) -> None:
        self.records += 1
        if self.config.spool is not None:
            self.config.spool.append(self._redactor.redact(record))

    def _record_base(self, client: connection.Client) -> TrafficRecord:
        state = self._conn(client)
        identity = state.identity
        return TrafficRecord(
            cvm_id=identity.cvm_id if identity else None,
            owner=identity.owner if identity else None,
            team=identity.team if identity else None,
            connect_host=state.connect_raw,
            sni=client.sni,
            port=state.connect_port,
        )

    def _log_flow(
        self, flow: http.HTTPFlow, decision: str, reason: str, detail: str = "", **extra: Any
    ) -> None:
        if flow.metadata.get(_LOGGED):
            return
        flow.metadata[_LOGGED] = True
        record = self._record_base(flow.client_conn)
        fstate = self._flows.get(flow.id) or FlowState()
        conn = self._conn(flow.client_conn)
        record.method = flow.request.method[:16]
        record.host_header = (flow.request.host_header or "")[:260] or None
        if conn.connect_raw is None:
            record.connect_host = flow.request.host[:260]
            record.port = flow.request.port
        record.policy_hash = fstate.effective.policy.hash if fstate.effective else None
        if fstate.decision is not None:
            record.path = fstate.decision.path
            record.rule_id = fstate.decision.rule_id
        record.query_keys = fstate.query_keys
        record.decision = decision
        record.reason = reason
        record.detail = detail[:300]
        record.scan_rule_ids = sorted(fstate.scan_rule_ids)
        record.injected_headers = fstate.injected_headers
        record.request_bytes = len(flow.request.raw_content or b"")
        record.duration_ms = round((time.monotonic() - fstate.started) * 1000, 3)
        if flow.server_conn.peername:
            record.pinned_ip = str(flow.server_conn.peername[0])
        for key, value in extra.items():
            setattr(record, key, value)
        self._emit(record)

    def _deny(self, flow: http.HTTPFlow, denial: Denied) -> None:
        headers = {"content-type": "text/plain", "x-umbra-reason": denial.reason}
        if denial.status == 407:
            headers["proxy-authenticate"] = 'Basic realm="umbra"'
        flow.response = http.Response.make(
            denial.status, f"umbra: denied ({denial.reason})\n".encode(), headers
        )
        flow.metadata[_DECIDED] = "deny"
        self._log_flow(
            flow,
            "deny",
            denial.reason,
            denial.detail,
            status=denial.status,
            **({"rule_id": denial.rule_id} if denial.rule_id else {}),
        )
        self._flows.pop(flow.id, None)

    # ---------------------------------------------------------------- connections

    @_guard("connection")
    def client_connected(self, client: connection.Client) -> None:
        state = self._conn(client)
        host, port = client.peername[0], client.peername[1]
        state.identity = self.config.identities.by_source(str(host), int(port))

    def client_disconnected(self, client: connection.Client) -> None:
        self._conns.pop(client.id, None)

    @_guard("connection")
    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        state = self._conn(nextlayer.context.client)
        if state.tunnel_rule is not None and state.connect_host is not None:
            nextlayer.layer = layers.TCPLayer(nextlayer.context)
            return
        chosen = nextlayer.layer
        if isinstance(chosen, (layers.TCPLayer, layers.UDPLayer, layers.DNSLayer)) or (
            type(chosen).__name__ in ("RawQuicLayer", "ServerQuicLayer", "ClientQuicLayer")
        ):
            # No raw TCP, UDP, DNS or QUIC except an explicit tunnel: parse it as HTTP instead,
            # which fails for anything that is not HTTP.
            nextlayer.layer = layers.HttpLayer(nextlayer.context, HTTPMode.transparent)

    @_guard("connection")
    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        data.ignore_connection = False
        data.establish_server_tls_first = False

    @_guard("server")
    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        state = self._conn(data.client)
        if data.server.address is None:
            raise ValueError("no server address")
        raw_host, port = str(data.server.address[0]), int(data.server.address[1])
        if state.poisoned:
            data.server.error = f"connection is poisoned: {state.poisoned}"
            return
        host = normalize_host(raw_host)
        pinned_name = state.pinned_names.get((host, port))
        if pinned_name is not None:
            # mitmproxy asks for a further connection by the address it dialled before: that
            # address was checked for `pinned_name`; check it again and dial it.
            verdict = self.config.addresses.check(ipaddress.ip_address(host), port)
            if verdict is not AddressVerdict.OK:
                data.server.error = f"refused address ({verdict})"
                self._log_connection(data.client, host, port, f"address_{verdict}", host)
                return
            data.server.sni = pinned_name
            return
        if (host, port) not in state.authorized:
            data.server.error = "no allowed decision for this destination"
            self._log_connection(data.client, host, port, "unauthorized_dial", data.server.error)
            return
        addresses: list[IPAddress]
        literal = parse_ip(host)
        if literal is not None:
            addresses = [literal]
        else:
            try:
                addresses = await self.config.resolver.resolve(host)
            except ResolutionError as exc:
                data.server.error = str(exc)
                self._log_connection(data.client, host, port, "dns_failure", str(exc))
                return
        for address in addresses:
            verdict = self.config.addresses.check(address, port)
            if verdict is not AddressVerdict.OK:
                data.server.error = f"{host} resolves to a refused address ({verdict})"
                self._log_connection(
                    data.client, host, port, f"address_{verdict}", str(address), pinned=address
                )
                return
        pinned = addresses[0]
        state.pinned[(host, port)] = str(pinned)
        if literal is None:
            state.pinned_names[(str(pinned), port)] = host
            data.server.sni = host
        # Dial exactly the address that was checked (mitmproxy would otherwise resolve again).
        data.server.address = (str(pinned), port)

    def _log_connection(
        self,
        client: connection.Client,
        host: str,
        port: int,
        reason: str,
        detail: str,
        pinned: IPAddress | None = None,
    ) -> None:
        record = self._record_base(client)
        record.kind = "connection"
        record.connect_host = record.connect_host or host
        record.port = port
        record.reason = reason
        record.detail = detail[:300]
        record.status = 502
        record.pinned_ip = str(pinned) if pinned is not None else None
        self._emit(record)

    # ---------------------------------------------------------------- CONNECT

    def _authenticate(self, flow: http.HTTPFlow, state: ConnState) -> CvmIdentity:
        header_values = flow.request.headers.get_all("proxy-authorization")
        for name in _STRIP_REQUEST:
            while name in flow.request.headers:
                del flow.request.headers[name]
        if len(header_values) > 1:
            raise Denied(407, "unknown_identity", "more than one Proxy-Authorization header")
        if header_values:
            identity = self.config.identities.by_proxy_auth(header_values[0])
            if identity is None:
                raise Denied(407, "unknown_identity", "proxy credentials not recognised")
            if state.identity is not None and state.identity.cvm_id != identity.cvm_id:
                raise Denied(407, "identity_conflict", "credentials name a different CVM")
            state.identity = identity
        if state.identity is None:
            raise Denied(407, "unknown_identity", "no tunnel identity for this connection")
        return state.identity

    @_guard("flow")
    def http_connect(self, flow: http.HTTPFlow) -> None:
        state = self._conn(flow.client_conn)
        try:
            identity = self._authenticate(flow, state)
            if state.connect_host is not None:
                raise Denied(400, "nested_connect", "CONNECT inside a CONNECT tunnel")
            raw = flow.request.host
            try:
                host = normalize_host(raw)
            except NormalizationError as exc:
                raise Denied(400, "invalid_host", str(exc)) from None
            port = flow.request.port
            state.connect_raw, state.connect_host, state.connect_port = raw[:260], host, port
            effective = self.config.state.effective(identity)
            self._flow(flow).effective = effective
            tunnel = effective.policy.decide_tunnel(host, port)
            if tunnel.allowed:
                state.tunnel_rule = tunnel.rule_id
                state.authorized.add((host, port))
                flow.metadata[_DECIDED] = "allow"
                self._log_flow(
                    flow,
                    "allow",
                    str(tunnel.reason),
                    kind="tunnel",
                    rule_id=tunnel.rule_id,
                    status=200,
                )
        except Denied as denial:
            self._deny(flow, denial)

    # ---------------------------------------------------------------- HTTP requests

    def _names(self, flow: http.HTTPFlow, state: ConnState) -> tuple[str, int, str]:
        """Check CONNECT target, SNI and Host/:authority agree; return (host, port, scheme)."""
        request = flow.request
        hosts = request.headers.get_all("host")
        if len(hosts) > 1:
            raise Denied(400, "duplicate_host", "more than one Host header")
        host_header = request.host_header
        if not host_header:
            raise Denied(400, "missing_host", "request has no Host or :authority")
        try:
            header_host, header_port = _split_authority(host_header)
        except (ValueError, NormalizationError) as exc:
            raise Denied(421, "name_mismatch", f"Host is not a valid authority: {exc}") from None
        if state.connect_host is not None and state.connect_port is not None:
            target, port = state.connect_host, state.connect_port
            scheme = "https" if flow.client_conn.tls else "http"
        else:
            try:
                target = normalize_host(request.host)
            except NormalizationError as exc:
                raise Denied(400, "invalid_host", str(exc)) from None
            port, scheme = request.port, request.scheme
        if header_host != target:
            raise Denied(421, "name_mismatch", "Host does not match the connect target")
        if header_port is not None and header_port != port:
            raise Denied(421, "name_mismatch", "Host port does not match the connect port")
        for extra in hosts:
            # HTTP/2 may carry a `host` header beside :authority; it must name the same host.
            try:
                extra_host, extra_port = _split_authority(extra)
            except (ValueError, NormalizationError):
                raise Denied(421, "name_mismatch", "Host is not a valid authority") from None
            if extra_host != target or extra_port not in (None, port):
                raise Denied(421, "name_mismatch", "Host header differs from :authority")
        if request.authority and not request.is_http2 and state.connect_host is not None:
            try:
                authority_host, authority_port = _split_authority(request.authority)
            except (ValueError, NormalizationError):
                raise Denied(
                    421, "name_mismatch", "request target is not a valid authority"
                ) from None
            if authority_host != target or (authority_port not in (None, port)):
                raise Denied(421, "name_mismatch", "absolute-form target differs")
        if flow.client_conn.tls:
            sni = flow.client_conn.sni
            if sni is None:
                if parse_ip(target) is None:
                    raise Denied(421, "name_mismatch", "TLS without SNI for a named host")
            else:
                try:
                    if normalize_host(sni) != target:
                        raise Denied(421, "name_mismatch", "SNI does not match the connect target")
                except NormalizationError:
                    raise Denied(421, "name_mismatch", "SNI is not a valid host name") from None
        return target, port, scheme

    def _sanity(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        if request.method not in _ALLOWED_METHODS:
            raise Denied(405, "method_not_supported", f"method {request.method[:16]!r}")
        upgrade = request.headers.get_all("upgrade")
        if upgrade and [value.strip().lower() for value in upgrade] != ["websocket"]:
            raise Denied(400, "upgrade_refused", "only WebSocket upgrades are proxied")
        if "http2-settings" in request.headers:
            raise Denied(400, "upgrade_refused", "h2c upgrade is not supported")
        te = request.headers.get_all("transfer-encoding")
        if te:
            if "content-length" in request.headers:
                raise Denied(400, "smuggling", "both Transfer-Encoding and Content-Length")
            if [value.strip().lower() for value in te] != ["chunked"]:
                raise Denied(400, "smuggling", "Transfer-Encoding other than a single 'chunked'")
        lengths = request.headers.get_all("content-length")
        if len(lengths) > 1 or (lengths and not lengths[0].strip().isdigit()):
            raise Denied(400, "smuggling", "ambiguous Content-Length")
        if lengths and int(lengths[0]) > self.config.max_body:
            raise Denied(
                413, "body_too_large", f"declared body exceeds {self.config.max_body} bytes"
            )
        for name, value in request.headers.items(multi=True):
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value or "\x00" in value:
                raise Denied(400, "smuggling", "control characters in a header")

    def _gate(self, flow: http.HTTPFlow) -> None:
        """Identity, sanity, names and the policy decision; raises Denied."""
        state = self._conn(flow.client_conn)
        fstate = self._flow(flow)
        if state.poisoned:
            raise Denied(500, "internal_error", state.poisoned)
        identity = self._authenticate(flow, state)
        fstate.effective = self.config.state.effective(identity)
        if fstate.effective.error:
            raise Denied(403, "policy_unavailable", fstate.effective.error)
        if state.tunnel_rule is not None:
            raise Denied(400, "tunnel_is_raw", "HTTP inside a raw tunnel")
        self._sanity(flow)
        host, port, scheme = self._names(flow, state)
        path = flow.request.path
        if not path.startswith("/"):
            raise Denied(400, "invalid_path", "request target is not origin-form")
        query = path.partition("?")[2]
        fstate.query_keys = sorted(
            {key[:64] for key, _ in parse_qsl(query, keep_blank_values=True)}
        )[:_MAX_QUERY_KEYS]
        decision = fstate.effective.policy.decide(flow.request.method, scheme, host, port, path)
        fstate.decision = decision
        if not decision.allowed:
            raise Denied(403, str(decision.reason), decision.detail, decision.rule_id)

    @_guard("flow")
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT" or flow.metadata.get(_DECIDED):
            return
        try:
            self._gate(flow)
            flow.metadata[_DECIDED] = "headers-ok"
        except Denied as denial:
            self._deny(flow, denial)

    @_guard("flow")
    def request(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT":
            return
        if flow.metadata.get(_DECIDED) == "deny" or flow.response is not None:
            if not flow.metadata.get(_LOGGED):
                self._deny(flow, Denied(403, "denied", "answered before forwarding"))
            return
        try:
            if flow.metadata.get(_DECIDED) != "headers-ok":
                self._gate(flow)
            self._scan_and_inject(flow)
            flow.metadata[_DECIDED] = "allow"
        except Denied as denial:
            self._deny(flow, denial)

    def _scan_and_inject(self, flow: http.HTTPFlow) -> None:
        state = self._conn(flow.client_conn)
        fstate = self._flow(flow)
        assert fstate.effective is not None and fstate.decision is not None
        request = flow.request
        body = request.raw_content or b""
        if len(body) > self.config.max_body:
            raise Denied(413, "body_too_large", f"body exceeds {self.config.max_body} bytes")
        encoding = ",".join(request.headers.get_all("content-encoding"))
        try:
            decoded = content_decode(body, encoding, 4 * self.config.max_body) if encoding else body
        except DecodeLimit as exc:
            raise Denied(413, "body_too_large", str(exc)) from None
        except DecodeError as exc:
            raise Denied(400, "undecodable_content", str(exc)) from None
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
            result = fstate.effective.scanner.scan_request(
                head, decoded, content_type, self.config.max_body
            )
        except ScanError as exc:
            raise Denied(413 if exc.reason == "scan_limit" else 400, exc.reason, str(exc)) from None
        fstate.scan_rule_ids = sorted(result.rule_ids)
        if result.rule_ids:
            raise Denied(403, "secret_detected", ",".join(sorted(result.rule_ids)))
        host = state.connect_host or normalize_host(request.host)
        injections = fstate.effective.policy.injections_for(host)
        bound = {rule.secret for rule in injections}
        unbound = sorted(result.placeholders - bound)
        if unbound:
            fstate.scan_rule_ids = [f"placeholder:{ref}" for ref in unbound]
            raise Denied(
                403, "placeholder_unbound", "placeholder for a secret not bound to this host"
            )
        if not injections:
            flow.metadata[STREAM_RESPONSE] = True
            state.authorized.add(
                (host, request.port if state.connect_port is None else state.connect_port)
            )
            return
        if request.scheme != "https":
            raise Denied(403, "injection_requires_tls", "credentials are only injected over TLS")
        identity = state.identity
        assert identity is not None
        try:
            rendered = render_injections(
                injections, self.config.state.secrets, identity.owner, host
            )
        except InjectionError as exc:
            raise Denied(403, "secret_unavailable", str(exc), exc.rule_id) from None
        except ValueError:
            raise Denied(403, "secret_unavailable", "secret value cannot be rendered") from None
        injected = apply_injections(
            request.headers, rendered, self.config.state.secrets, identity.owner, host
        )
        fstate.injected_headers = injected.header_names
        fstate.injected_values = injected.values
        flow.metadata[STREAM_RESPONSE] = False
        state.authorized.add((host, state.connect_port or request.port))

    # ---------------------------------------------------------------- responses

    @_guard("flow")
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is None:
            return
        for name in ("alt-svc",):
            while name in flow.response.headers:
                del flow.response.headers[name]
        if flow.metadata.get(_DECIDED) == "allow" and flow.metadata.get(STREAM_RESPONSE):
            fstate = self._flow(flow)

            def count(chunk: bytes) -> bytes:
                fstate.response_bytes += len(chunk)
                return chunk

            flow.response.stream = count

    @_guard("flow")
    def response(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT":
            self._flows.pop(flow.id, None)
            return
        if flow.metadata.get(_DECIDED) != "allow" or flow.response is None:
            if not flow.metadata.get(_LOGGED):
                self._deny(flow, Denied(403, "not_decided", "response for an undecided request"))
            return
        fstate = self._flow(flow)
        response = flow.response
        for name in ("alt-svc",):
            while name in response.headers:
                del response.headers[name]
        if fstate.injected_values:
            self._check_reflection(flow, fstate)
            if flow.metadata.get(_LOGGED):
                return
        size = fstate.response_bytes or len(response.raw_content or b"")
        self._log_flow(
            flow,
            "allow",
            "rule_allow",
            status=response.status_code,
            response_bytes=size,
        )
        if flow.websocket is None:
            self._flows.pop(flow.id, None)

    def _check_reflection(self, flow: http.HTTPFlow, fstate: FlowState) -> None:
        response = flow.response
        assert response is not None and fstate.effective is not None
        head = "\r\n".join(f"{k}: {v}" for k, v in response.headers.items(multi=True)).encode(
            "utf-8", "surrogateescape"
        )
        body = response.raw_content or b""
        try:
            encoding = ",".join(response.headers.get_all("content-encoding"))
            decoded = content_decode(body, encoding, 4 * self.config.max_body) if encoding else body
        except (DecodeError, DecodeLimit):
            decoded = None
        hit = decoded is None or any(
            form in part
            for value in fstate.injected_values
            for form in secret_encodings(value.encode())
            for part in (head, decoded)
        )
        if hit:
            status = response.status_code
            flow.response = http.Response.make(
                502,
                b"umbra: denied (response reflects an injected credential)\n",
                {"content-type": "text/plain", "x-umbra-reason": "credential_reflected"},
            )
            self._log_flow(
                flow,
                "deny",
                "credential_reflected",
                f"upstream status {status}" if decoded is not None else "undecodable response",
                status=502,
            )

    @_guard("flow")
    def error(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get(_LOGGED):
            return
        message = flow.error.msg if flow.error else "error"
        reason, status = "upstream_error", 502
        if "body_size_limit" in message:
            reason, status = "body_too_large", 413
        elif "smuggling" in message or "Received" in message:
            reason, status = "invalid_request", 400
        elif message.startswith("Connection killed"):
            reason = "upstream_refused"  # server_connect refused the dial (logged with why)
        elif "killed" in message.lower():
            reason, status = "killed", None  # type: ignore[assignment]
        decision = (
            "deny"
            if flow.metadata.get(_DECIDED) != "allow" or reason == "upstream_refused"
            else "error"
        )
        self._log_flow(flow, decision, reason, message[:200], status=status)
        self._flows.pop(flow.id, None)

    # ---------------------------------------------------------------- WebSocket

    @_guard("flow")
    def websocket_message(self, flow: http.HTTPFlow) -> None:
        assert flow.websocket is not None
        message = flow.websocket.messages[-1]
        fstate = self._flow(flow)
        if fstate.effective is None:
            message.drop()
            flow.kill()
            return
        content = message.content
        reason = ""
        if message.from_client:
            try:
                result = fstate.effective.scanner.scan_request(
                    b"", content, "", self.config.max_body
                )
            except ScanError as exc:
                reason, rule_ids = exc.reason, [exc.reason]
            else:
                host = self._conn(flow.client_conn).connect_host or ""
                bound = {rule.secret for rule in fstate.effective.policy.injections_for(host)}
                rule_ids = sorted(result.rule_ids) + [
                    f"placeholder:{ref}" for ref in sorted(result.placeholders - bound)
                ]
                if rule_ids:
                    reason = "secret_detected"
        else:
            rule_ids = []
            if fstate.injected_values and any(
                value.encode() in content for value in fstate.injected_values
            ):
                reason, rule_ids = "credential_reflected", ["reflection"]
        if reason:
            message.drop()
            record = self._record_base(flow.client_conn)
            record.kind = "websocket"
            record.method = "WS"
            record.reason = reason
            record.scan_rule_ids = rule_ids
            record.policy_hash = fstate.effective.policy.hash
            record.host_header = flow.request.host_header
            self._emit(record)
            flow.kill()

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        self._flows.pop(flow.id, None)

    # ---------------------------------------------------------------- everything else

    @_guard("tcp")
    def tcp_start(self, flow: tcp.TCPFlow) -> None:
        state = self._conn(flow.client_conn)
        if state.tunnel_rule is None or state.poisoned:
            flow.kill()

    @_guard("tcp")
    def udp_start(self, flow: udp.UDPFlow) -> None:
        flow.kill()


def _split_authority(value: str) -> tuple[str, int | None]:
    value = value.strip()
    if value.startswith("["):
        close = value.find("]")
        if close < 0:
            raise ValueError("unbalanced bracket")
        host, rest = value[: close + 1], value[close + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError("garbage after IPv6 literal")
        port_text = rest[1:] if rest else ""
    elif value.count(":") == 1:
        host, port_text = value.split(":")
    else:
        host, port_text = value, ""
    if "@" in host:
        raise ValueError("userinfo in authority")
    port: int | None = None
    if port_text:
        if not port_text.isdigit() or len(port_text) > 5:
            raise ValueError("invalid port")
        port = int(port_text)
    normalized = normalize_host(host)
    if port is not None and not 1 <= port <= 65535:
        raise ValueError("invalid port")
    _ = ipaddress  # IPv6 literals are normalized by normalize_host
    return normalized, port
