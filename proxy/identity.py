"""Who sent a request: the CVM (and its owner) behind a client connection.

Contract: identity is established by whoever terminates the authenticated tunnel from a Dev CVM's
forwarder (the tunnel endpoint, `tunnel.py`), never by anything inside the sandbox. The endpoint
presents each sandbox connection from a loopback source it registered for that CVM
(`tunnel_identities.py`); non-tunnel clients may be identified by a source range reserved for a CVM
or by `Proxy-Authorization: Basic base64(cvm_id:credential)`. An `IdentitySource` maps a client
connection to a `CvmIdentity`; no mapping means the request is denied.

Local mode reads a static identities file (this module); the Console-attached owner/team/profiles
of a CVM (`Attachments`) override the file's when a Console is configured.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Protocol

import yaml
from pydantic import AfterValidator, Field, ValidationError

from umbra.contracts.model import Strict as _Strict

_SHA256_HEX = 64


@dataclass(frozen=True, slots=True)
class CvmIdentity:
    cvm_id: str
    owner: str
    team: str
    profiles: tuple[str, ...]


class IdentitySource(Protocol):
    def by_source(self, host: str, port: int) -> CvmIdentity | None:
        """The CVM a connection from this source address/port belongs to, if any."""
        ...

    def by_proxy_auth(self, header_value: str) -> CvmIdentity | None:
        """The CVM whose tunnel endpoint presented this Proxy-Authorization value, if any."""
        ...


def _check_source(value: str) -> str:
    network, _, ports = value.partition(" ports ")
    ipaddress.ip_network(network, strict=True)
    if ports:
        low, _, high = ports.partition("-")
        if not (1 <= int(low) <= int(high or low) <= 65535):
            raise ValueError("port range must be LOW-HIGH within 1..65535")
    return value


def _check_sha256(value: str) -> str:
    if len(value) != _SHA256_HEX or any(char not in "0123456789abcdef" for char in value):
        raise ValueError("must be a lowercase hex SHA-256 digest")
    return value


SourceRange = Annotated[str, AfterValidator(_check_source)]
Sha256Hex = Annotated[str, AfterValidator(_check_sha256)]


class CvmEntry(_Strict):
    cvm_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    owner: str = Field(min_length=1, max_length=128)
    team: str = Field(min_length=1, max_length=128)
    profiles: list[str] = Field(default_factory=list)
    credential_sha256: Sha256Hex | None = Field(
        default=None, description="SHA-256 of the credential presented as Basic cvm_id:credential."
    )
    sources: list[SourceRange] = Field(
        default_factory=list, description="'CIDR' or 'CIDR ports LOW-HIGH' the endpoint uses."
    )


class IdentitiesFile(_Strict):
    cvms: list[CvmEntry]


class Attachment(_Strict):
    owner: str = Field(min_length=1, max_length=128)
    team: str = Field(min_length=1, max_length=128)
    profiles: list[str]
    # Set once the Dev CVM enrolled: its tunnel credential's SHA-256 (the Console's record).
    credential_sha256: Sha256Hex | None = None


class AttachmentsDocument(_Strict):
    """What `GET {console}/api/v1/security-cvms/{id}/attachments` returns."""

    cvms: dict[str, Attachment]


class IdentityError(Exception):
    pass


def hash_credential(credential: str) -> str:
    return hashlib.sha256(credential.encode()).hexdigest()


def proxy_auth_header(cvm_id: str, credential: str) -> str:
    return "Basic " + base64.b64encode(f"{cvm_id}:{credential}".encode()).decode("ascii")


@dataclass(frozen=True)
class _Range:
    network: ipaddress.IPv4Network | ipaddress.IPv6Network
    low: int
    high: int


class StaticIdentities:
    """Local-mode identity source: the identities file, overlaid by Console attachments if any."""

    def __init__(self, entries: list[CvmEntry]) -> None:
        ids = [entry.cvm_id for entry in entries]
        if len(ids) != len(set(ids)):
            raise IdentityError("identities file names a cvm_id twice")
        self._entries = {entry.cvm_id: entry for entry in entries}
        self._ranges: list[tuple[_Range, str]] = []
        for entry in entries:
            for source in entry.sources:
                network, _, ports = source.partition(" ports ")
                low, _, high = ports.partition("-") if ports else ("1", "", "65535")
                self._ranges.append(
                    (
                        _Range(ipaddress.ip_network(network), int(low), int(high or low)),
                        entry.cvm_id,
                    )
                )
        self._lock = threading.Lock()
        self._attachments: Mapping[str, Attachment] | None = None

    @classmethod
    def from_file(cls, path: Path) -> StaticIdentities:
        try:
            text = path.read_text()
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
            parsed = IdentitiesFile.model_validate(data)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            detail = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            raise IdentityError(f"{path}: not a valid identities file: {detail}") from None
        return cls(parsed.cvms)

    def set_attachments(self, attachments: Mapping[str, Attachment] | None) -> None:
        """Console-served owner/team/profiles per CVM; with them set, CVMs not listed are unknown."""
        with self._lock:
            self._attachments = dict(attachments) if attachments is not None else None

    def _identity(self, cvm_id: str) -> CvmIdentity | None:
        entry = self._entries.get(cvm_id)
        with self._lock:
            attachments = self._attachments
        if attachments is not None:
            attached = attachments.get(cvm_id)
            # Known by the file, or enrolled at the Console (it then needs no file entry).
            if attached is None or (entry is None and attached.credential_sha256 is None):
                return None
            return CvmIdentity(cvm_id, attached.owner, attached.team, tuple(attached.profiles))
        if entry is None:
            return None
        return CvmIdentity(cvm_id, entry.owner, entry.team, tuple(entry.profiles))

    def _credential_sha256(self, cvm_id: str) -> str | None:
        """The Console's (enrollment) hash when it has one, else the identities file's."""
        with self._lock:
            attachments = self._attachments
        attached = attachments.get(cvm_id) if attachments is not None else None
        if attached is not None and attached.credential_sha256 is not None:
            return attached.credential_sha256
        entry = self._entries.get(cvm_id)
        return entry.credential_sha256 if entry is not None else None

    def lookup(self, cvm_id: str) -> CvmIdentity | None:
        """The CVM's identity if it is known (in the file and, with a Console, attached)."""
        return self._identity(cvm_id)

    def credential_matches(self, cvm_id: str, credential: str) -> bool:
        """Constant-time check of a tunnel credential; False when the CVM has none configured."""
        expected = self._credential_sha256(cvm_id)
        if expected is None or self._identity(cvm_id) is None:
            return False
        return hmac.compare_digest(hash_credential(credential), expected)

    def by_source(self, host: str, port: int) -> CvmIdentity | None:
        try:
            address = ipaddress.ip_address(host.removeprefix("::ffff:"))
        except ValueError:
            return None
        for source, cvm_id in self._ranges:
            if address in source.network and source.low <= port <= source.high:
                return self._identity(cvm_id)
        return None

    def by_proxy_auth(self, header_value: str) -> CvmIdentity | None:
        scheme, _, token = header_value.strip().partition(" ")
        if scheme.lower() != "basic" or not token:
            return None
        try:
            decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        cvm_id, sep, credential = decoded.partition(":")
        if not sep or not self.credential_matches(cvm_id, credential):
            return None
        return self._identity(cvm_id)
