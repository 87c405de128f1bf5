"""Secrets for injection, released by the Console only to this attested Security CVM.

Each round: take a fresh nonce, make an ephemeral X25519 key, get a quote whose report_data binds
nonce, this CVM's id and the key (`release_protocol`), and open the HPKE-sealed answer with the key.
The store is swapped whole; on any failure the last good store stays. Until the first release
succeeds the store is empty, so every injection is refused (`secret_unavailable`): fail closed.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from collections.abc import Callable, Sequence

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from pydantic import ValidationError

from umbra.attest.eventlog import Event, dump_dstack_event_log
from umbra.attest.quote_source import QuoteSource
from umbra.contracts.release import (
    SUITE,
    ReleaseDocument,
    expected_report_data,
    hpke_info,
)
from umbra.contracts.secret_kinds import SecretKind, StaticSecret, parse_material
from umbra.proxy.secrets import HostBindings, Material, SecretKey, SecretsError, SecretStore
from umbra.proxy.state import PolicyState

logger = logging.getLogger(__name__)


class SecretReleaseError(Exception):
    """A release that did not produce secrets; the message never holds a secret value."""


class SecretPuller:
    def __init__(
        self,
        console_url: str,
        security_cvm_id: str,
        quote_source: QuoteSource,
        event_log: Callable[[], Sequence[Event]] | None,
        state: PolicyState,
        client: httpx.AsyncClient,
        *,
        interval: float = 300.0,
        long_poll: float = 25.0,
    ) -> None:
        self.base = console_url.rstrip("/") + f"/api/v1/security-cvms/{security_cvm_id}"
        self.security_cvm_id = security_cvm_id
        self.quote_source = quote_source
        self.event_log = event_log
        self.state = state
        self.interval = interval
        self.long_poll = long_poll
        self._client = client
        self.last_error: str | None = None
        self.releases = 0

    async def fetch(self) -> SecretStore:
        challenge = await self._post("/release-challenge", None)
        nonce = challenge.get("nonce")
        if not isinstance(nonce, str) or not nonce:
            raise SecretReleaseError("the Console's challenge has no nonce")
        key = X25519PrivateKey.generate()
        public = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        report_data = expected_report_data(nonce, self.security_cvm_id, public)
        quote = await asyncio.to_thread(self.quote_source.get_quote, report_data)
        events = self.event_log() if self.event_log is not None else None
        evidence = {
            "nonce": nonce,
            "quote": base64.b64encode(quote).decode(),
            "event_log": base64.b64encode(dump_dstack_event_log(events).encode()).decode()
            if events
            else None,
            "public_key": base64.b64encode(public).decode(),
        }
        answer = await self._post("/secrets/release", evidence)
        try:
            sealed = base64.b64decode(str(answer.get("sealed", "")), validate=True)
            plaintext = SUITE.decrypt(sealed, key, info=hpke_info(self.security_cvm_id, nonce))
            document = ReleaseDocument.model_validate_json(plaintext)
        except (binascii.Error, ValueError, ValidationError):
            raise SecretReleaseError("the sealed release does not open or parse") from None
        if document.security_cvm_id != self.security_cvm_id or document.nonce != nonce:
            raise SecretReleaseError("the release is for another CVM or another challenge")
        return _store(document)

    async def _post(self, path: str, body: object) -> dict[str, object]:
        try:
            response = await self._client.post(self.base + path, json=body)
        except httpx.HTTPError as exc:
            raise SecretReleaseError(f"Console unreachable ({type(exc).__name__})") from None
        if response.status_code != 200:
            detail = response.text[:300].replace("\n", " ")
            raise SecretReleaseError(f"{path}: HTTP {response.status_code}: {detail}")
        payload = response.json()
        if not isinstance(payload, dict):
            raise SecretReleaseError(f"{path}: the Console's answer is not an object")
        return payload

    async def run_once(self) -> bool:
        try:
            store = await self.fetch()
        except (SecretReleaseError, SecretsError) as exc:
            self.last_error = str(exc)
            logger.error("secret release failed, keeping the last good secrets: %s", exc)
            return False
        except Exception as exc:  # e.g. the quote source; its text may quote inputs, so not logged
            self.last_error = type(exc).__name__
            logger.error(
                "secret release failed (%s), keeping the last good secrets", type(exc).__name__
            )
            return False
        self.state.install_secrets(store)
        self.releases += 1
        self.last_error = None
        logger.info("secrets released by the Console: %d value(s)", len(store.all_values()))
        return True

    async def version(self, known: str | None, wait: float) -> str | None:
        """Long-poll the version of what a release would carry; None when the Console cannot say
        (then the release runs every `interval`)."""
        headers = {"If-None-Match": known} if known else {}
        try:
            response = await self._client.get(
                self.base + "/secrets/version",
                headers=headers,
                params={"wait": str(int(wait))},
                timeout=wait + 10,
            )
        except httpx.HTTPError as exc:
            logger.error("secrets version: Console unreachable (%s)", type(exc).__name__)
            return None
        if response.status_code in (200, 304) and response.headers.get("etag"):
            return response.headers["etag"]
        logger.error("secrets version: HTTP %d", response.status_code)
        return None

    async def run(self) -> None:
        """Release, then re-release whenever the Console's secrets version changes (rotation,
        deletion, a host binding); a failed release is retried within 5 s."""
        released: str | None = None
        have_released = False
        loop = asyncio.get_running_loop()
        last_release = float("-inf")
        while True:
            started = loop.time()
            current = await self.version(released, self.long_poll if have_released else 0)
            if current is None:
                due = loop.time() - last_release >= self.interval
            else:
                due = current != released
            if not have_released or due:
                if not await self.run_once():
                    await asyncio.sleep(min(self.interval, 5.0))
                    continue
                released, last_release, have_released = current, loop.time(), True
            if current is None:
                await asyncio.sleep(min(self.interval, 5.0))
            elif not due and loop.time() - started < 0.5:
                # A Console that answers at once without a change: not a hot loop. An answer that
                # carried a change is followed at once, so back-to-back changes converge too.
                await asyncio.sleep(0.5)


def _store(document: ReleaseDocument) -> SecretStore:
    team: dict[str, str] = {}
    personal: dict[str, dict[str, str]] = {}
    hosts: HostBindings = {}
    materials: dict[SecretKey, Material] = {}
    for item in document.secrets:
        kind, _, name = item.ref.partition("/")
        try:
            value = base64.b64decode(item.value, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise SecretReleaseError(f"secret {item.ref} is not valid text") from None
        if not ((kind == "team" and item.owner is None) or (kind == "personal" and item.owner)):
            raise SecretReleaseError(f"secret {item.ref} has an unexpected scope or owner")
        if item.kind != SecretKind.static:
            try:
                parsed = parse_material(item.kind, value)
            except ValueError:  # ValidationError too; neither message is logged with input
                raise SecretReleaseError(f"secret {item.ref} is not a valid {item.kind}") from None
            assert not isinstance(parsed, StaticSecret)
            materials[(item.ref, item.owner)] = Material(parsed, item.version, item.needs_login)
        elif kind == "team":
            team[name] = value
        else:
            assert item.owner is not None
            personal.setdefault(item.owner, {})[name] = value
        # A team secret set without hosts is bound by the policy's inject rules alone; personal
        # secrets always name their hosts.
        if item.hosts or kind == "personal":
            hosts[(item.ref, item.owner)] = frozenset(item.hosts)
    return SecretStore(team, personal, hosts, materials)
