"""`RefreshPersister` over the Console's secret-refresh routes (`umbra.contracts.secret_refresh`,
console/services/secret_refresh.py), with the Security CVM's own credential."""

from __future__ import annotations

from typing import Any

import httpx

from umbra.proxy.mint_errors import CredentialRefused, CredentialUnavailable, LeaseBusy
from umbra.proxy.secrets import SecretKey


class ConsoleRefresh:
    """`RefreshPersister` over the Console's secret-refresh routes, with the Security CVM's own
    credential (the client the secret puller uses)."""

    def __init__(self, client: httpx.AsyncClient, console_url: str, security_cvm_id: str) -> None:
        self.client = client
        self.base = (
            console_url.rstrip("/") + f"/api/v1/security-cvms/{security_cvm_id}/secret-refresh"
        )

    @staticmethod
    def _at(key: SecretKey, version: int) -> dict[str, Any]:
        return {"ref": key[0], "owner": key[1], "version": version}

    async def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return await self.client.post(self.base + path, json=body, timeout=10)
        except httpx.HTTPError as exc:
            raise CredentialUnavailable(f"Console unreachable ({type(exc).__name__})") from None

    async def lease(self, key: SecretKey, version: int) -> str:
        response = await self._post("/lease", self._at(key, version))
        if response.status_code in (409, 412):
            if "needs a new login" in response.text:
                raise CredentialRefused("the Console marks this credential as needing a login")
            raise LeaseBusy()
        if response.status_code != 200:
            raise CredentialUnavailable(f"refresh lease: HTTP {response.status_code}")
        lease = response.json().get("lease")
        if not isinstance(lease, str):
            raise CredentialUnavailable("refresh lease: no lease in the answer")
        return lease

    async def commit(self, key: SecretKey, version: int, lease: str, document: str) -> int:
        body = self._at(key, version) | {"lease": lease, "document": document}
        response = await self._post("/commit", body)
        if response.status_code != 200:
            raise CredentialUnavailable(f"refresh commit: HTTP {response.status_code}")
        return int(response.json()["version"])

    async def failure(
        self, key: SecretKey, version: int, lease: str, refused: bool, detail: str
    ) -> None:
        body = self._at(key, version) | {"lease": lease, "refused": refused, "detail": detail[:200]}
        response = await self._post("/failure", body)
        if response.status_code != 204:
            raise CredentialUnavailable(f"refresh failure report: HTTP {response.status_code}")
