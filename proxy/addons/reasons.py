"""Every reason the proxy gives for a decision, each carrying the HTTP status it answers with.

The strings are stable: they are what traffic-log records, the Console and tests see. Policy
decisions keep the matcher's own reasons (`umbra.policy.Reason`), mirrored here so a record
always carries a member of this one enum.
"""

from __future__ import annotations

from enum import StrEnum

from umbra.policy import Reason as PolicyReason


class Reason(StrEnum):
    status: int | None

    def __new__(cls, value: str, status: int | None = None) -> Reason:
        member = str.__new__(cls, value)
        member._value_ = value
        member.status = status
        return member

    # identity (407) and connection state
    UNKNOWN_IDENTITY = "unknown_identity", 407
    IDENTITY_CONFLICT = "identity_conflict", 407
    INTERNAL_ERROR = "internal_error", 500
    POLICY_UNAVAILABLE = "policy_unavailable", 403
    # request sanity (400/405/413) and name agreement (421)
    NESTED_CONNECT = "nested_connect", 400
    INVALID_HOST = "invalid_host", 400
    METHOD_NOT_SUPPORTED = "method_not_supported", 405
    METHOD_OVERRIDE = "method_override", 400
    UPGRADE_REFUSED = "upgrade_refused", 400
    SMUGGLING = "smuggling", 400
    BODY_TOO_LARGE = "body_too_large", 413
    DUPLICATE_HOST = "duplicate_host", 400
    MISSING_HOST = "missing_host", 400
    NAME_MISMATCH = "name_mismatch", 421
    INVALID_PATH = "invalid_path", 400
    TUNNEL_IS_RAW = "tunnel_is_raw", 400
    # policy decision (403)
    RULE_ALLOW = "rule_allow", 200
    RULE_DENY = "rule_deny", 403
    NO_MATCHING_RULE = "no_matching_rule", 403
    NO_POLICY = "no_policy", 403
    INVALID_METHOD = "invalid_method", 403
    INVALID_SCHEME = "invalid_scheme", 403
    INVALID_PORT = "invalid_port", 403
    PUSH_REF_DENIED = "push_ref_denied", 403
    MALFORMED_PUSH = "malformed_push", 400
    BUDGET_EXCEEDED = "budget_exceeded", 429
    # request fields and MCP tools (`body`/`mcp` on an allow rule); an MCP refusal of a request
    # with an id is answered as a JSON-RPC error (200), see addons/fields.py
    BODY_FIELD_DENIED = "body_field_denied", 403
    BODY_UNREADABLE = "body_unreadable", 400
    BODY_LIMIT = "body_limit", 413
    MCP_TOOL_DENIED = "mcp_tool_denied", 403
    MCP_METHOD_DENIED = "mcp_method_denied", 403
    MCP_MALFORMED = "mcp_malformed", 400
    # an MCP server's tool list differs from the one first seen (recorded; the response passes)
    MCP_TOOLS_CHANGED = "mcp_tools_changed", None
    # an LLM API reported usage that is not believable (negative, huge, not a number): recorded,
    # not summed
    USAGE_INVALID = "usage_invalid", None
    # scanning and injection
    SECRET_DETECTED = "secret_detected", 403
    PLACEHOLDER_UNBOUND = "placeholder_unbound", 403
    UNDECODABLE_CONTENT = "undecodable_content", 400
    SCAN_LIMIT = "scan_limit", 413
    MALFORMED_PACKFILE = "malformed_packfile", 400
    MALFORMED_ARCHIVE = "malformed_archive", 400
    MALFORMED_GRPC = "malformed_grpc", 400
    INJECTION_REQUIRES_TLS = "injection_requires_tls", 403
    SECRET_UNAVAILABLE = "secret_unavailable", 403
    # a minted credential (proxy/minting.py): the token endpoint refused it (a new login is
    # needed), or was slow or down (bounded wait)
    CREDENTIAL_REFRESH_FAILED = "credential_refresh_failed", 403
    CREDENTIAL_UNAVAILABLE = "credential_unavailable", 503
    # AWS SigV4 re-signing (proxy/sigv4.py)
    SIGV4_MISSING = "sigv4_missing", 403
    SIGV4_MALFORMED = "sigv4_malformed", 400
    SIGV4_SCOPE_REFUSED = "sigv4_scope_refused", 403
    SIGV4_UNSUPPORTED = "sigv4_unsupported", 400
    # flow bookkeeping
    DENIED = "denied", 403
    NOT_DECIDED = "not_decided", 403
    # WebSocket control frames: a ping's payload was answered hop by hop, a pong's dropped, or a close
    # reason emptied; none of them reached the other side
    WS_CONTROL_NOT_RELAYED = "ws_control_not_relayed", None
    # responses
    CREDENTIAL_REFLECTED = "credential_reflected", 502
    # errors after forwarding
    UPSTREAM_ERROR = "upstream_error", 502
    UPSTREAM_REFUSED = "upstream_refused", 502
    CLIENT_ERROR = "client_error", 400
    INVALID_REQUEST = "invalid_request", 400
    KILLED = "killed", None
    # dialling (record kind `connection`)
    UNAUTHORIZED_DIAL = "unauthorized_dial", 502
    DNS_FAILURE = "dns_failure", 502
    # the tunnel endpoint refused a Dev CVM's session (record kind `connection`; no HTTP answer)
    TUNNEL_ATLS_FAILED = "tunnel_atls_failed", None
    TUNNEL_HEADER_TIMEOUT = "tunnel_header_timeout", None
    TUNNEL_CLOSED = "tunnel_closed", None
    TUNNEL_HEADER_TOO_LARGE = "tunnel_header_too_large", None
    TUNNEL_MALFORMED_HEADER = "tunnel_malformed_header", None
    TUNNEL_UNKNOWN_CVM = "tunnel_unknown_cvm", None
    TUNNEL_MISSING_CREDENTIAL = "tunnel_missing_credential", None
    TUNNEL_BAD_CREDENTIAL = "tunnel_bad_credential", None
    TUNNEL_NO_CA = "tunnel_no_ca", None
    TUNNEL_NO_ENV = "tunnel_no_env", None
    TUNNEL_PROXY_UNREACHABLE = "tunnel_proxy_unreachable", None

    @classmethod
    def of_policy(cls, reason: PolicyReason) -> Reason:
        return cls(str(reason))
