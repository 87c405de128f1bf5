"""The identity header: the first application bytes the forwarder sends inside an attested
session, before any byte from the sandbox. The tunnel endpoint on the Security CVM reads it.

    header = u32be length ‖ JSON object (UTF-8, sorted keys, no spaces), 2 ≤ length ≤ 4096
    {"v": 1, "cvm_id": "<id>", "mode": "proxy"}
    {"v": 1, "cvm_id": "<id>", "mode": "tunnel", "tunnel": "<name>", "host": "<dest>", "port": N}
    {"v": 1, "cvm_id": "<id>", "mode": "ca"}
    {"v": 1, "cvm_id": "<id>", "mode": "env"}
    optional in all: "credential": "<per-CVM secret delivered at launch>"

`ca` asks for the Security CVM's interception CA certificate(s) instead of a relay: the endpoint
answers with one reply (`u32be length ‖ PEM`, 1 ≤ length ≤ MAX_CA_REPLY) and closes. Because it
arrives inside the attested session, the forwarder knows it comes from the verified Security CVM
and no network can substitute its own CA (docs/specs/sandbox.md, "The interception CA").
`env` asks, the same way, for the `sandbox_env` of the profiles attached to this CVM now: one
reply (`u32be length ‖ canonical JSON object of name → value`, 1 ≤ length ≤ MAX_ENV_REPLY).

Every value comes from the forwarder's own configuration (launch-bound and measured), never from
anything the sandbox sent: in tunnel mode the destination is the one configured for the port
the sandbox connected to.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from umbra.contracts.canonical import canonical_json
from umbra.contracts.names import CVM_ID_PATTERN, check_host
from umbra.contracts.sandbox_env import check_env

VERSION = 1
MAX_HEADER = 4096
MAX_CA_REPLY = 64 * 1024  # a few PEM certificates; both sides use this bound
MAX_ENV_REPLY = 1024 * 1024  # several profiles of 64 variables of up to 4096 characters each
Mode = Literal["proxy", "tunnel", "ca", "env"]
MODES: tuple[str, ...] = ("proxy", "tunnel", "ca", "env")
_CVM_ID = re.compile(CVM_ID_PATTERN)
_TUNNEL = re.compile(r"^[a-z][a-z0-9-]{0,30}$")


class HeaderError(Exception):
    """The identity header is malformed; the tunnel endpoint must drop the connection."""


class HeaderClosed(HeaderError):
    """The peer closed the session before a whole header arrived."""


class HeaderTooLarge(HeaderError):
    """The header's length prefix is outside 2..MAX_HEADER (refused before buffering it)."""


@dataclass(frozen=True)
class TunnelHeader:
    cvm_id: str
    mode: Mode
    tunnel: str | None = None
    host: str | None = None
    port: int | None = None
    credential: str | None = None

    def __post_init__(self) -> None:
        if not _CVM_ID.match(self.cvm_id):
            raise HeaderError(f"cvm_id must match {CVM_ID_PATTERN}")
        if self.mode == "tunnel":
            if self.tunnel is None or not _TUNNEL.match(self.tunnel):
                raise HeaderError("tunnel mode needs a tunnel name")
            if self.host is None or self.port is None or not 1 <= self.port <= 65535:
                raise HeaderError("tunnel mode needs host and a port in 1..65535")
            try:
                check_host(self.host)
            except ValueError as exc:
                raise HeaderError(str(exc)) from None
        elif self.mode in ("proxy", "ca", "env"):
            if self.tunnel is not None or self.host is not None or self.port is not None:
                raise HeaderError(f"{self.mode} mode carries no destination")
        else:
            raise HeaderError(f"unknown mode {self.mode!r}")
        if self.credential is not None and not (
            1 <= len(self.credential) <= 256 and self.credential.isascii()
        ):
            raise HeaderError("credential must be 1-256 ASCII characters")

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"v": VERSION, "cvm_id": self.cvm_id, "mode": self.mode}
        for key in ("tunnel", "host", "port", "credential"):
            if getattr(self, key) is not None:
                doc[key] = getattr(self, key)
        return doc


def encode_header(header: TunnelHeader) -> bytes:
    body = canonical_json(header.to_json(), ascii_only=True)
    if len(body) > MAX_HEADER:
        raise HeaderError(f"header of {len(body)} bytes exceeds {MAX_HEADER}")
    return struct.pack(">I", len(body)) + body


def decode_header_body(body: bytes) -> TunnelHeader:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise HeaderError("header is not UTF-8 JSON") from None
    if not isinstance(doc, dict):
        raise HeaderError("header must be a JSON object")
    if doc.get("v") != VERSION:
        raise HeaderError(f"header version {doc.get('v')!r} is not {VERSION}")
    allowed = {"v", "cvm_id", "mode", "tunnel", "host", "port", "credential"}
    if set(doc) - allowed:
        raise HeaderError(f"unknown header fields: {', '.join(sorted(set(doc) - allowed))}")
    fields: dict[str, Any] = {k: doc.get(k) for k in allowed - {"v"}}
    if not all(isinstance(fields[k], str | None) for k in ("cvm_id", "mode", "tunnel", "host")):
        raise HeaderError("header fields have the wrong types")
    if not isinstance(fields["credential"], str | None):
        raise HeaderError("header fields have the wrong types")
    if fields["port"] is not None and type(fields["port"]) is not int:
        raise HeaderError("port must be an integer")
    if not isinstance(fields["cvm_id"], str) or fields["mode"] not in MODES:
        raise HeaderError("header needs cvm_id and mode (proxy, tunnel, ca or env)")
    return TunnelHeader(**fields)


def parse_length(prefix: bytes) -> int:
    (n,) = struct.unpack(">I", prefix)
    if not 2 <= n <= MAX_HEADER:
        raise HeaderError(f"header length {n} is outside 2..{MAX_HEADER}")
    return int(n)


async def read_header(recv: Callable[[int], Awaitable[bytes]]) -> tuple[TunnelHeader, bytes]:
    """The tunnel endpoint's side (`proxy/tunnel.py`): read exactly one header from `recv` (e.g.
    ATLSConnection.recv), never a byte past it, and return it with the bytes that came with it.

    Raises `HeaderClosed`, `HeaderTooLarge` or (fields) `HeaderError`; a field's message may quote
    what the peer sent, so the endpoint logs its own words for it."""
    buf = b""
    need = 4
    while len(buf) < need:
        chunk = await recv(max(need - len(buf), 1))
        if not chunk:
            raise HeaderClosed("connection closed before the identity header")
        buf += chunk
        if need == 4 and len(buf) >= 4:
            try:
                need = 4 + parse_length(buf[:4])
            except HeaderError as exc:
                raise HeaderTooLarge(str(exc)) from None
    try:
        return decode_header_body(buf[4:need]), buf[need:]
    except (TypeError, ValueError):
        raise HeaderError("header fields are invalid") from None


def encode_ca_reply(pem: bytes) -> bytes:
    """The tunnel endpoint's answer to a `ca` header."""
    if not 1 <= len(pem) <= MAX_CA_REPLY:
        raise HeaderError(f"CA reply of {len(pem)} bytes is outside 1..{MAX_CA_REPLY}")
    return struct.pack(">I", len(pem)) + pem


async def read_ca_reply(recv: Callable[[int], Awaitable[bytes]]) -> bytes:
    """The forwarder's side: exactly one CA reply, bounded before anything is buffered."""
    buf = b""
    need = 4
    while len(buf) < need:
        chunk = await recv(need - len(buf))
        if not chunk:
            raise HeaderError("connection closed before the whole CA reply")
        buf += chunk
        if need == 4 and len(buf) == 4:
            (n,) = struct.unpack(">I", buf)
            if not 1 <= n <= MAX_CA_REPLY:
                raise HeaderError(f"CA reply length {n} is outside 1..{MAX_CA_REPLY}")
            need = 4 + n
    return buf[4:]


def encode_env_reply(env: dict[str, str]) -> bytes:
    """The tunnel endpoint's answer to an `env` header."""
    body = canonical_json(env)
    if len(body) > MAX_ENV_REPLY:
        raise HeaderError(f"env reply of {len(body)} bytes is over {MAX_ENV_REPLY}")
    return struct.pack(">I", len(body)) + body


async def read_env_reply(recv: Callable[[int], Awaitable[bytes]]) -> dict[str, str]:
    """The forwarder's side: one env reply, bounded first, then a JSON object of strings, every
    entry one a profile may set (contracts/sandbox_env.py): anything else refuses it whole."""
    buf = b""
    need = 4
    while len(buf) < need:
        chunk = await recv(need - len(buf))
        if not chunk:
            raise HeaderError("connection closed before the whole env reply")
        buf += chunk
        if need == 4 and len(buf) == 4:
            (n,) = struct.unpack(">I", buf)
            if not 1 <= n <= MAX_ENV_REPLY:
                raise HeaderError(f"env reply length {n} is outside 1..{MAX_ENV_REPLY}")
            need = 4 + n
    try:
        doc = json.loads(buf[4:])
    except ValueError:
        raise HeaderError("env reply is not JSON") from None
    if not isinstance(doc, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in doc.items()
    ):
        raise HeaderError("env reply is not an object of strings")
    try:
        check_env(doc)  # the names the sandbox owns, control characters, lengths
    except ValueError as exc:
        raise HeaderError(f"env reply refused: {exc}") from None
    return doc
