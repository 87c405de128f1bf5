"""A Security CVM's view of the Console API for tests: pull bundle and attachments, ship traffic,
ask for secrets (the proxy itself has its own pullers; this is the test side's typed client)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from umbra.console.client import DEFAULT_TIMEOUT, _Base
from umbra.console.schemas import AttachmentsDoc, IngestResult, ReleaseChallenge, ReleaseResponse


@dataclass(frozen=True)
class Polled:
    """A long-poll answer: `changed` False means 304 (keep what you have)."""

    changed: bool
    etag: str | None
    body: bytes


class SecurityCvmClient(_Base):
    """For a Security CVM's proxy: pull bundle and attachments, ship traffic, ask for secrets."""

    def __init__(self, base_url: str, token: str, cvm_id: str, **kwargs: Any) -> None:
        super().__init__(base_url, token, **kwargs)
        self.cvm_id = cvm_id

    def _poll(self, what: str, etag: str | None, wait: int) -> Polled:
        headers = {"If-None-Match": f'"{etag}"'} if etag else {}
        timeout = httpx.Timeout(DEFAULT_TIMEOUT + wait)
        response = self._request(
            "GET",
            f"/api/v1/security-cvms/{self.cvm_id}/{what}",
            ok=(200, 304),
            params={"wait": wait},
            headers=headers,
            timeout=timeout,
        )
        tag = response.headers.get("ETag", "").strip('"') or None
        return Polled(response.status_code == 200, tag, response.content)

    def bundle(self, etag: str | None = None, wait: int = 0) -> Polled:
        """The signed bundle bytes (verify them with pinned keys before use)."""
        return self._poll("bundle", etag, wait)

    def attachments(
        self, etag: str | None = None, wait: int = 0
    ) -> tuple[Polled, AttachmentsDoc | None]:
        polled = self._poll("attachments", etag, wait)
        doc = AttachmentsDoc.model_validate_json(polled.body) if polled.changed else None
        return polled, doc

    def ship_traffic(self, records: list[dict[str, Any]]) -> IngestResult:
        return self._model(
            IngestResult, "POST", "/api/v1/traffic/batches", json={"records": records}
        )

    def release_challenge(self) -> ReleaseChallenge:
        return self._model(
            ReleaseChallenge, "POST", f"/api/v1/security-cvms/{self.cvm_id}/release-challenge"
        )

    def release(self, evidence: dict[str, Any]) -> ReleaseResponse:
        return self._model(
            ReleaseResponse,
            "POST",
            f"/api/v1/security-cvms/{self.cvm_id}/secrets/release",
            json=evidence,
        )
