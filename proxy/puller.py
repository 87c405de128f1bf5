"""Pulls the signed policy bundle and the CVM attachments from the Console.

`GET {console}/api/v1/security-cvms/{id}/bundle` returns the signed bundle bytes with an ETag; the
puller sends `If-None-Match` and treats 304 as "unchanged". A bundle is installed only when its
signature verifies against the pinned keys and its serial is not lower than the current one (an
equal serial must carry the same hash). Anything else keeps the last good bundle. The last good
bundle is cached on disk and re-verified at start-up.

`GET {console}/api/v1/security-cvms/{id}/attachments` returns
`{"cvms": {"<cvm_id>": {"owner": ..., "team": ..., "profiles": [...]}}}` with an ETag as well.

Both are long polls (`?wait=`): the Console answers as soon as something changed, so a new bundle
takes effect within about a second without polling every half second. A Console that answers at
once without a change is polled no faster than `interval`; an answer that carried a change is
followed by the next long poll at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError

from umbra.contracts.files import write_atomic
from umbra.policy import BundleError, VerifiedBundle, verify_bundle
from umbra.proxy.identity import AttachmentsDocument, StaticIdentities
from umbra.proxy.state import PolicyState

logger = logging.getLogger(__name__)


class RollbackError(BundleError):
    pass


def accept_bundle(
    raw: bytes, keys: Sequence[Ed25519PublicKey], current: VerifiedBundle | None
) -> VerifiedBundle:
    """Verify `raw` and refuse a rollback; raise BundleError otherwise."""
    bundle = verify_bundle(raw, keys)
    if current is not None:
        if bundle.serial < current.serial:
            raise RollbackError(
                f"bundle serial {bundle.serial} is lower than the enforced {current.serial}"
            )
        if bundle.serial == current.serial and bundle.hash != current.hash:
            raise RollbackError(f"bundle serial {bundle.serial} reused with different content")
    return bundle


class PolicyPuller:
    def __init__(
        self,
        console_url: str,
        security_cvm_id: str,
        keys: Sequence[Ed25519PublicKey],
        state: PolicyState,
        identities: StaticIdentities | None,
        cache_dir: Path | None,
        *,
        interval: float = 0.5,
        long_poll: float = 25.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        base = console_url.rstrip("/") + f"/api/v1/security-cvms/{security_cvm_id}"
        self.bundle_url = base + "/bundle"
        self.attachments_url = base + "/attachments"
        self.keys = list(keys)
        self.state = state
        self.identities = identities
        self.cache = cache_dir / "bundle.json" if cache_dir else None
        self.attachments_cache = cache_dir / "attachments.json" if cache_dir else None
        self.interval = interval
        self._attachments_raw: bytes | None = None
        self.long_poll = long_poll
        self._client = client or httpx.AsyncClient(timeout=10)
        self._bundle_etag: str | None = None
        self._attachments_etag: str | None = None
        self.last_error: str | None = None

    def load_cache(self) -> None:
        """Start from the last good bundle and attachments; with none, every CVM is unknown."""
        if self.identities is not None:
            self.identities.set_attachments({})
            if self.attachments_cache is not None and self.attachments_cache.exists():
                try:
                    document = AttachmentsDocument.model_validate_json(
                        self.attachments_cache.read_bytes()
                    )
                    self.identities.set_attachments(document.cvms)
                except (OSError, ValidationError):
                    logger.error(
                        "cached attachments unreadable; every CVM is unknown until the Console answers"
                    )
        if self.cache is None or not self.cache.exists():
            return
        try:
            bundle = accept_bundle(self.cache.read_bytes(), self.keys, self.state.source.bundle)
        except BundleError as exc:
            logger.error("cached bundle refused: %s", exc)
            return
        self.state.install(bundle=bundle)

    @staticmethod
    def _write_atomic(path: Path | None, raw: bytes) -> None:
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        # Owner-only: the attachments name credential hashes; synced, as the cache must survive
        # a crash.
        write_atomic(path, raw, 0o600, sync=True)

    def _save_cache(self, raw: bytes) -> None:
        self._write_atomic(self.cache, raw)

    async def _get(self, url: str, etag: str | None, wait: float) -> httpx.Response:
        headers = {"If-None-Match": etag} if etag else {}
        params = {"wait": str(int(wait))} if wait > 0 else {}
        return await self._client.get(url, headers=headers, params=params, timeout=wait + 10)

    async def poll_bundle(self, wait: float = 0) -> bool:
        """One conditional GET of the bundle (a long poll of up to `wait` s); True when a new
        bundle was installed."""
        response = await self._get(self.bundle_url, self._bundle_etag, wait)
        if response.status_code == 304:
            return False
        if response.status_code != 200:
            self.last_error = f"bundle endpoint answered {response.status_code}"
            return False
        try:
            bundle = accept_bundle(response.content, self.keys, self.state.source.bundle)
        except BundleError as exc:
            self.last_error = str(exc)
            logger.error(
                "refusing bundle from console, keeping %s: %s", self.state.source.label, exc
            )
            self._bundle_etag = response.headers.get("etag")
            return False
        self._bundle_etag = response.headers.get("etag")
        current = self.state.source.bundle
        if current is not None and current.hash == bundle.hash:
            return False
        self._save_cache(response.content)
        self.state.install(bundle=bundle)
        self.last_error = None
        return True

    async def poll_attachments(self, wait: float = 0) -> bool:
        if self.identities is None:
            return False
        response = await self._get(self.attachments_url, self._attachments_etag, wait)
        if response.status_code == 304:
            return False
        if response.status_code != 200:
            self.last_error = f"attachments endpoint answered {response.status_code}"
            return False
        try:
            document = AttachmentsDocument.model_validate_json(response.content)
        except ValidationError:
            self.last_error = "attachments document is invalid"
            logger.error("refusing attachments document from console (invalid)")
            return False
        self._attachments_etag = response.headers.get("etag")
        # The same document again (a Console ignoring If-None-Match) is no change: it is paced.
        changed = response.content != self._attachments_raw
        self._attachments_raw = response.content
        self._write_atomic(self.attachments_cache, response.content)
        self.identities.set_attachments(document.cvms)
        return changed

    async def run(self) -> None:
        await asyncio.gather(self._loop(self.poll_bundle), self._loop(self.poll_attachments))

    async def _loop(self, poll: Callable[[float], Awaitable[bool]]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            changed = False
            try:
                changed = await poll(self.long_poll)
            except httpx.HTTPError as exc:
                self.last_error = f"console unreachable ({type(exc).__name__})"
                logger.error("policy puller: %s; keeping the current policy", self.last_error)
            except Exception:
                logger.exception("policy puller failed; keeping the current policy")
            elapsed = loop.time() - started
            # Only an answer without a change is paced (a Console that does not long-poll); one
            # that carried a change is followed at once, so back-to-back publishes converge too.
            if not changed and elapsed < self.interval:
                await asyncio.sleep(self.interval - elapsed)
