"""The enrolling side: a booted CVM turns its one-time token into its long-lived credential.

Used by the Security CVM's proxy (`umbra proxy serve --enroll-token-file`) and the Dev CVM's
forwarder (`umbra forwarder enroll`). The X25519 key is generated in this process, inside the
(simulated) TEE, and never leaves it; the Console seals the credential to it after verifying the
quote that binds it. The credential is persisted root-only (0600, written via a temporary file and
renamed); the token's SHA-256 is recorded beside it, so a lost credential is never re-enrolled
with the spent token (the Console would refuse it and audit a reuse).
An attested client (it quotes and sends the event log), so it lives in `umbra.attest`.

A CVM that enrolled before and lost its credential (it lives on tmpfs: a reboot, a stop/start, a
re-create) **re-enrolls by a fresh quote** when given its launch events: it asks
`/enroll/renew/challenge` with its CVM id and the digest of its launch-bound events, quotes the
renewal binding and receives a new credential (console/reenrollment.py). A 409 there means "not
enrolled, or another launch": then the token path runs as at first boot.

A Console that does not answer at boot (its address unreachable, a TLS or transport failure) is
retried with backoff when the caller gives `retry_delays` (the proxy and forwarder give
BOOT_RETRY_DELAYS: about five minutes, well inside the token's hour), each attempt said through
`say`; then ConsoleUnreachable names the attempts. The Console marks a CVM that never enrolled
before its token expired `failed` with the reason (console/enrollment.py, `umbra cvm list`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import ipaddress
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from umbra.attest.eventlog import Event, dump_dstack_event_log
from umbra.attest.launch_binding import LaunchBindingError, launch_binding
from umbra.contracts.enrollment import (
    hpke_info,
    launch_binding_sha256,
    renew_hpke_info,
    renew_report_data,
    report_data,
)
from umbra.contracts.files import write_atomic
from umbra.contracts.release import SUITE

# report_data -> (quote, event log to send or None)
Quoter = Callable[[bytes], tuple[bytes, Sequence[Event] | None]]


class EnrollError(Exception):
    """Enrollment failed; the message says why (the Console's refusal reason when refused)."""


class ConsoleUnreachable(EnrollError):
    """No answer from the Console (connection, TLS or transport failure): worth retrying."""


# Seconds between boot-time attempts: doubling to a minute, about five minutes in all.
BOOT_RETRY_DELAYS: tuple[float, ...] = (2, 4, 8, 16, 32, 60, 60, 60, 60)


def spent_marker(credential_file: Path) -> Path:
    return credential_file.with_name(credential_file.name + ".token-sha256")


def _read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise EnrollError(f"{path}: cannot read the enrollment token ({exc.strerror})") from None
    if not 8 <= len(token) <= 128 or not token.isascii() or not token.isprintable():
        raise EnrollError(f"{path}: not an enrollment token (8-128 printable ASCII)")
    return token


def read_credential(path: Path) -> str | None:
    try:
        value = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise EnrollError(f"{path}: cannot read the credential ({exc.strerror})") from None
    if not value or not value.isascii() or not value.isprintable() or " " in value:
        raise EnrollError(f"{path}: the stored credential is not one printable token")
    return value


def _write_root_only(path: Path, data: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_atomic(path, data + "\n", 0o600)


def ensure_credential(
    *,
    console_url: str,
    cvm_id: str,
    token_file: Path | None,
    credential_file: Path,
    quoter: Quoter,
    verify: ssl.SSLContext | str | bool = True,
    timeout: float = 30.0,
    connect_address: str | None = None,
    launch_events: Sequence[Event] | None = None,
    retry_delays: Sequence[float] = (),
    say: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[str, bool]:
    """`_ensure_credential` with a Console that does not answer retried after each of
    `retry_delays` (seconds); the last failure names how many attempts were made."""
    attempts = len(retry_delays) + 1
    for attempt, delay in enumerate((*retry_delays, None), 1):
        try:
            return _ensure_credential(
                console_url=console_url, cvm_id=cvm_id, token_file=token_file,
                credential_file=credential_file, quoter=quoter, verify=verify, timeout=timeout,
                connect_address=connect_address, launch_events=launch_events,
            )  # fmt: skip
        except ConsoleUnreachable as exc:
            if delay is None:
                if attempts == 1:
                    raise
                raise ConsoleUnreachable(f"{exc}; gave up after {attempts} attempts") from None
            if say is not None:
                say(f"enrollment: {exc}; attempt {attempt}/{attempts}, retrying in {delay:g} s")
            sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises


def _ensure_credential(
    *,
    console_url: str,
    cvm_id: str,
    token_file: Path | None,
    credential_file: Path,
    quoter: Quoter,
    verify: ssl.SSLContext | str | bool,
    timeout: float,
    connect_address: str | None,
    launch_events: Sequence[Event] | None,
) -> tuple[str, bool]:
    """The persisted credential, enrolling first when there is none. Returns (credential,
    enrolled now). Raises EnrollError, never with the token or the credential in its text.

    `connect_address`: dial this IP instead of resolving the URL's host (a cloud Dev CVM has no
    DNS); TLS still verifies the certificate for the URL's host name (SNI and Host too).
    `launch_events`: this TD's event log; with it, a CVM that enrolled before re-enrolls by a
    fresh quote (no token), and the token is spent only when the Console has no such launch."""
    stored = read_credential(credential_file)
    if stored is not None:
        return stored, False
    if launch_events is not None:
        renewed = _renew(
            console_url, cvm_id, quoter, verify, timeout, connect_address, launch_events
        )
        if renewed is not None:
            _write_root_only(credential_file, renewed)
            return renewed, True
    if token_file is None:
        raise EnrollError(f"{credential_file}: no credential yet and no enrollment token given")
    token = _read_token(token_file)
    token_sha = hashlib.sha256(token.encode()).hexdigest()
    with contextlib.suppress(OSError):
        if spent_marker(credential_file).read_text().strip() == token_sha:
            raise EnrollError(
                f"{credential_file} is missing and the enrollment token in {token_file} was "
                "already spent on it; mint a new token (POST /api/v1/cvms/{id}/enrollment-token)"
            )
    key, public = _key_pair()
    base, route = _route(console_url, connect_address)
    with httpx.Client(timeout=timeout, verify=verify) as client:
        challenge = _post(client, f"{base}/enroll/challenge", {"token": token}, route)
        nonce = str(challenge.get("nonce", ""))
        if not nonce:
            raise EnrollError("the Console's challenge has no nonce")
        quote, events = _quote(quoter, report_data(nonce, cvm_id, public))
        evidence = {
            "token": token,
            "nonce": nonce,
            "quote": base64.b64encode(quote).decode(),
            "public_key": base64.b64encode(public).decode(),
            "event_log": base64.b64encode(dump_dstack_event_log(events).encode()).decode()
            if events
            else None,
        }
        answer = _post(client, f"{base}/enroll", evidence, route)
    if answer.get("cvm_id") != cvm_id:
        raise EnrollError("the Console enrolled another CVM than this one")
    credential = _open(answer, key, hpke_info(cvm_id, nonce))
    _write_root_only(credential_file, credential)
    _write_root_only(spent_marker(credential_file), token_sha)
    with contextlib.suppress(OSError):
        token_file.unlink()  # spent: nothing left in the launch directory worth stealing
    return credential, True


def _renew(
    console_url: str,
    cvm_id: str,
    quoter: Quoter,
    verify: ssl.SSLContext | str | bool,
    timeout: float,
    connect_address: str | None,
    launch_events: Sequence[Event],
) -> str | None:
    """A fresh credential by quote, or None when the Console has no enrollment of this launch."""
    try:
        binding = launch_binding(launch_events)
    except LaunchBindingError:
        return None  # no measured launch to show: only a token can enroll this CVM
    key, public = _key_pair()
    base, route = _route(console_url, connect_address)
    with httpx.Client(timeout=timeout, verify=verify) as client:
        hint = {"cvm_id": cvm_id, "launch_sha256": launch_binding_sha256(binding)}
        challenge = _post(client, f"{base}/enroll/renew/challenge", hint, route, conflict=True)
        if challenge is None:
            return None
        nonce = str(challenge.get("nonce", ""))
        if not nonce:
            raise EnrollError("the Console's renewal challenge has no nonce")
        quote, events = _quote(quoter, renew_report_data(nonce, cvm_id, public))
        evidence = {
            "cvm_id": cvm_id,
            "nonce": nonce,
            "quote": base64.b64encode(quote).decode(),
            "public_key": base64.b64encode(public).decode(),
            "event_log": base64.b64encode(
                dump_dstack_event_log(events or launch_events).encode()
            ).decode(),
        }
        answer = _post(client, f"{base}/enroll/renew", evidence, route)
    if answer is None or answer.get("cvm_id") != cvm_id:
        raise EnrollError("the Console renewed another CVM than this one")
    return _open(answer, key, renew_hpke_info(cvm_id, nonce))


def _key_pair() -> tuple[X25519PrivateKey, bytes]:
    """The key the credential is sealed to: generated here, inside the TEE, per enrollment."""
    key = X25519PrivateKey.generate()
    return key, key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )


def _quote(quoter: Quoter, report: bytes) -> tuple[bytes, Sequence[Event] | None]:
    try:
        return quoter(report)
    except Exception as exc:  # the TEE's own failure, named
        raise EnrollError(f"cannot quote: {type(exc).__name__}: {exc}") from None


def _open(answer: Mapping[str, Any], key: X25519PrivateKey, info: bytes) -> str:
    """The credential the Console sealed to `key` (HPKE, `info` binds CVM and nonce)."""
    try:
        sealed = base64.b64decode(str(answer.get("sealed_credential", "")), validate=True)
        return SUITE.decrypt(sealed, key, info=info).decode("ascii")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise EnrollError("the sealed credential does not open") from None


@dataclass(frozen=True)
class _Route:
    host_header: str | None = None
    sni_hostname: str | None = None


def _route(console_url: str, connect_address: str | None) -> tuple[str, _Route]:
    """The API base URL to dial, and what keeps TLS bound to the Console's name."""
    url = httpx.URL(console_url.rstrip("/") + "/api/v1")
    if connect_address is None:
        return str(url), _Route()
    try:
        ip = ipaddress.IPv4Address(connect_address)
    except ValueError:
        raise EnrollError(f"Console address {connect_address!r} is not an IPv4 address") from None
    host = url.host
    netloc = host if url.port is None else f"{host}:{url.port}"
    return str(url.copy_with(host=str(ip))), _Route(host_header=netloc, sni_hostname=host)


@overload
def _post(client: httpx.Client, url: str, body: object, route: _Route) -> dict[str, object]: ...
@overload
def _post(
    client: httpx.Client, url: str, body: object, route: _Route, conflict: bool
) -> dict[str, object] | None: ...
def _post(
    client: httpx.Client, url: str, body: object, route: _Route, conflict: bool = False
) -> dict[str, object] | None:
    """The JSON answer; None for a 409 when `conflict` (renewal: not enrolled)."""
    headers = {"Host": route.host_header} if route.host_header else None
    extensions = {"sni_hostname": route.sni_hostname} if route.sni_hostname else None
    try:
        response = client.post(url, json=body, headers=headers, extensions=extensions)
    except httpx.HTTPError as exc:
        raise ConsoleUnreachable(f"Console unreachable at {url} ({type(exc).__name__})") from None
    if conflict and response.status_code == 409:
        return None
    if response.status_code != 200:
        try:
            detail = str(response.json().get("detail", ""))[:300]
        except ValueError:
            detail = response.text[:300]
        raise EnrollError(f"enrollment refused by the Console ({response.status_code}): {detail}")
    doc = response.json()
    if not isinstance(doc, dict):
        raise EnrollError("the Console answered something other than a JSON object")
    return doc
