# mypy: disable-error-code="no-untyped-call"
"""Request sanity (400/405/413) and name agreement (421): checks that need no policy."""

from __future__ import annotations

import ipaddress

from mitmproxy import http

from umbra.policy import NormalizationError, normalize_host
from umbra.policy.model import METHODS
from umbra.proxy.addons.base import Denied, UmbraAddon, deny, guard
from umbra.proxy.addons.reasons import Reason
from umbra.proxy.addons.state import ConnState, flow_state
from umbra.proxy.netcheck import parse_ip

_ALLOWED_METHODS = frozenset(METHODS)
# Frameworks that honour these run the named method instead of the request's: a GET-only rule
# would let a DELETE through.
METHOD_OVERRIDE_HEADERS = ("x-http-method-override", "x-http-method", "x-method-override")


class RequestSanity(UmbraAddon):
    @guard
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT" or flow_state(flow).denied:
            return
        try:
            self.check(flow)
            names(flow, self.shared.conns.get(flow.client_conn))
        except Denied as denial:
            deny(self.shared, flow, denial)

    def check(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        max_body = self.shared.max_body
        if request.method not in _ALLOWED_METHODS:
            raise Denied(Reason.METHOD_NOT_SUPPORTED, f"method {request.method[:16]!r}")
        # One pass over the raw header fields (each `in`/`get_all` on mitmproxy's headers is a
        # pass of its own); the checks below keep their order.
        present: set[bytes] = set()
        watched: dict[bytes, list[str]] = {b"upgrade": [], b"transfer-encoding": [],
                                           b"content-length": []}  # fmt: skip
        control = False
        for name, value in request.headers.fields:
            lowered = name.lower()
            present.add(lowered)
            values = watched.get(lowered)
            if values is not None:
                values.append(value.decode("utf-8", "surrogateescape"))
            if b"\r" in name or b"\n" in name or b"\r" in value or b"\n" in value or b"\0" in value:
                control = True
        for header in METHOD_OVERRIDE_HEADERS:
            if header.encode() in present:
                raise Denied(Reason.METHOD_OVERRIDE, f"{header} is not forwarded")
        upgrade = watched[b"upgrade"]
        if upgrade and [value.strip().lower() for value in upgrade] != ["websocket"]:
            raise Denied(Reason.UPGRADE_REFUSED, "only WebSocket upgrades are proxied")
        if b"http2-settings" in present:
            raise Denied(Reason.UPGRADE_REFUSED, "h2c upgrade is not supported")
        te = watched[b"transfer-encoding"]
        lengths = watched[b"content-length"]
        if te:
            if lengths:
                raise Denied(Reason.SMUGGLING, "both Transfer-Encoding and Content-Length")
            if [value.strip().lower() for value in te] != ["chunked"]:
                raise Denied(Reason.SMUGGLING, "Transfer-Encoding other than a single 'chunked'")
        if len(lengths) > 1 or (lengths and not lengths[0].strip().isdigit()):
            raise Denied(Reason.SMUGGLING, "ambiguous Content-Length")
        if lengths and int(lengths[0]) > max_body:
            raise Denied(Reason.BODY_TOO_LARGE, f"declared body exceeds {max_body} bytes")
        if control:
            raise Denied(Reason.SMUGGLING, "control characters in a header")
        path = request.path
        if not path.startswith("/"):
            raise Denied(Reason.INVALID_PATH, "request target is not origin-form")
        if ";" in path.partition("?")[0]:
            # Tomcat, Jetty and Spring route `/admin;p/x` to `/admin/x`: a path deny would miss it.
            raise Denied(Reason.INVALID_PATH, "path parameters (';') are not forwarded")


def names(flow: http.HTTPFlow, state: ConnState) -> None:
    """Check CONNECT target, SNI and Host/:authority agree."""
    request = flow.request
    hosts = request.headers.get_all("host")
    if len(hosts) > 1:
        raise Denied(Reason.DUPLICATE_HOST, "more than one Host header")
    host_header = request.host_header
    if not host_header:
        raise Denied(Reason.MISSING_HOST, "request has no Host or :authority")
    try:
        header_host, header_port = split_authority(host_header)
    except (ValueError, NormalizationError) as exc:
        raise Denied(Reason.NAME_MISMATCH, f"Host is not a valid authority: {exc}") from None
    target, port, _scheme = connect_target(flow, state)
    if header_host != target:
        raise Denied(Reason.NAME_MISMATCH, "Host does not match the connect target")
    if header_port is not None and header_port != port:
        raise Denied(Reason.NAME_MISMATCH, "Host port does not match the connect port")
    for extra in hosts:
        # HTTP/2 may carry a `host` header beside :authority; it must name the same host.
        try:
            extra_host, extra_port = split_authority(extra)
        except (ValueError, NormalizationError):
            raise Denied(Reason.NAME_MISMATCH, "Host is not a valid authority") from None
        if extra_host != target or extra_port not in (None, port):
            raise Denied(Reason.NAME_MISMATCH, "Host header differs from :authority")
    if request.authority and not request.is_http2 and state.connect_host is not None:
        try:
            authority_host, authority_port = split_authority(request.authority)
        except (ValueError, NormalizationError):
            raise Denied(Reason.NAME_MISMATCH, "request target is not a valid authority") from None
        if authority_host != target or (authority_port not in (None, port)):
            raise Denied(Reason.NAME_MISMATCH, "absolute-form target differs")
    if flow.client_conn.tls:
        sni = flow.client_conn.sni
        if sni is None:
            if parse_ip(target) is None:
                raise Denied(Reason.NAME_MISMATCH, "TLS without SNI for a named host")
        else:
            try:
                if normalize_host(sni) != target:
                    raise Denied(Reason.NAME_MISMATCH, "SNI does not match the connect target")
            except NormalizationError:
                raise Denied(Reason.NAME_MISMATCH, "SNI is not a valid host name") from None


def connect_target(flow: http.HTTPFlow, state: ConnState) -> tuple[str, int, str]:
    """The flow's (host, port, scheme): the CONNECT target, or the absolute-form target."""
    request = flow.request
    if state.connect_host is not None and state.connect_port is not None:
        return state.connect_host, state.connect_port, "https" if flow.client_conn.tls else "http"
    try:
        target = normalize_host(request.host)
    except NormalizationError as exc:
        raise Denied(Reason.INVALID_HOST, str(exc)) from None
    return target, request.port, request.scheme


def split_authority(value: str) -> tuple[str, int | None]:
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
