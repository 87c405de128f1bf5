"""The typed HTTP client for the Console API: `ConsoleClient` for people (OIDC bearer token; used
by the `umbra` CLI). (A Security CVM's proxy pulls with its own pullers in `umbra.proxy`.)

Errors come back as `ConsoleApiError` with the status code and the server's precise `detail`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Self
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from umbra.console.enums import CvmKind, Power
from umbra.console.schemas import (
    AuditPage,
    BundleInfo,
    CvmCreated,
    CvmInfo,
    Deactivated,
    EnrollmentToken,
    Me,
    QuarantinePage,
    Reactivated,
    SecretInfo,
    SecurityReplicaToken,
    TeamDefaultProfiles,
    TeamQuotas,
    TeamQuotasInfo,
    TrafficPage,
    UsageReportOut,
)
from umbra.contracts.console_url import ConsoleUrlError, check_console_url

DEFAULT_TIMEOUT = 30.0


__all__ = ["ConsoleApiError", "ConsoleClient", "ConsoleUrlError"]


class ConsoleApiError(Exception):
    def __init__(self, status: int, detail: object) -> None:
        self.status = status
        self.detail = detail
        super().__init__(f"console answered {status}: {detail}")


def _detail(response: httpx.Response) -> object:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    return body.get("detail", body) if isinstance(body, dict) else body


def _if_version(version: int | None) -> dict[str, str]:
    return {} if version is None else {"If-Match": f'"{version}"'}


class _Base:
    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
        verify: bool | str = True,
    ) -> None:
        self._http = httpx.Client(
            base_url=check_console_url(base_url).rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            transport=transport,
            verify=verify,
            follow_redirects=False,
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(
        self, method: str, url: str, ok: tuple[int, ...] = (200,), **kwargs: Any
    ) -> httpx.Response:
        response = self._http.request(method, url, **kwargs)
        if response.status_code not in ok:
            raise ConsoleApiError(response.status_code, _detail(response))
        return response

    def _model[M: BaseModel](self, model: type[M], method: str, url: str, **kwargs: Any) -> M:
        return model.model_validate(self._request(method, url, **kwargs).json())


class ConsoleClient(_Base):
    """For people: every call is authorized by the caller's roles in the team."""

    def me(self) -> Me:
        return self._model(Me, "GET", "/api/v1/me")

    # bundles and profiles
    def upload_bundle(self, team: str, raw: bytes) -> BundleInfo:
        return self._model(
            BundleInfo,
            "POST",
            f"/api/v1/teams/{team}/bundles",
            ok=(200, 201),
            content=raw,
            headers={"Content-Type": "application/octet-stream"},
        )

    def list_bundles(self, team: str) -> list[BundleInfo]:
        response = self._request("GET", f"/api/v1/teams/{team}/bundles")
        return [BundleInfo.model_validate(item) for item in response.json()]

    def attach_profiles(
        self, cvm_id: str, profiles: list[str], *, if_match: str | None = None
    ) -> CvmInfo:
        headers = {"If-Match": f'"{if_match}"'} if if_match else {}
        return self._model(
            CvmInfo,
            "PUT",
            f"/api/v1/cvms/{cvm_id}/profiles",
            json={"profiles": profiles},
            headers=headers,
        )

    def default_profiles(self, team: str) -> TeamDefaultProfiles:
        return self._model(TeamDefaultProfiles, "GET", f"/api/v1/teams/{team}/default-profiles")

    def set_default_profiles(
        self, team: str, profiles: list[str], *, if_match: str | None = None
    ) -> TeamDefaultProfiles:
        headers = {"If-Match": f'"{if_match}"'} if if_match else {}
        return self._model(
            TeamDefaultProfiles,
            "PUT",
            f"/api/v1/teams/{team}/default-profiles",
            json={"profiles": profiles},
            headers=headers,
        )

    # Quotas and the machine-type catalog
    def quotas(self, team: str) -> TeamQuotasInfo:
        return self._model(TeamQuotasInfo, "GET", f"/api/v1/teams/{team}/quotas")

    def set_quotas(self, team: str, quotas: TeamQuotas) -> TeamQuotasInfo:
        return self._model(
            TeamQuotasInfo, "PUT", f"/api/v1/teams/{team}/quotas", json=quotas.model_dump()
        )

    # CVMs
    def create_cvm(
        self,
        team: str,
        name: str,
        *,
        kind: CvmKind = CvmKind.dev,
        provider: str = "local",
        security_cvm_id: str | None = None,
        owner: str | None = None,
        ssh_keys: list[str] | None = None,
        size: str | None = None,
        data_disk_gb: int | None = None,
    ) -> CvmInfo:
        body: dict[str, Any] = {"name": name, "kind": kind, "provider": provider}
        optional = {
            "security_cvm_id": security_cvm_id,
            "owner": owner,
            "ssh_keys": ssh_keys,
            "data_disk_gb": data_disk_gb,
        }
        body |= {key: value for key, value in optional.items() if value is not None}
        if size is not None:
            body["size"] = size
        return self._model(CvmInfo, "POST", f"/api/v1/teams/{team}/cvms", ok=(201,), json=body)

    def list_cvms(self, team: str, *, include_destroyed: bool = False) -> list[CvmInfo]:
        response = self._request(
            "GET", f"/api/v1/teams/{team}/cvms", params={"include_destroyed": include_destroyed}
        )
        return [CvmInfo.model_validate(item) for item in response.json()]

    def get_cvm(self, cvm_id: str) -> CvmInfo:
        return self._model(CvmInfo, "GET", f"/api/v1/cvms/{cvm_id}")

    def update_cvm(
        self,
        cvm_id: str,
        *,
        state: Power | None = None,
        security_cvm_id: str | None = None,
        ssh_keys: list[str] | None = None,
        size: str | None = None,
        data_disk_gb: int | None = None,
    ) -> CvmInfo:
        fields = {
            "state": state,
            "security_cvm_id": security_cvm_id,
            "ssh_keys": ssh_keys,
            "size": size,
            "data_disk_gb": data_disk_gb,
        }
        body = {k: v for k, v in fields.items() if v}
        return self._model(CvmInfo, "PATCH", f"/api/v1/cvms/{cvm_id}", json=body)

    def destroy_cvm(self, cvm_id: str) -> CvmInfo:
        return self._model(CvmInfo, "DELETE", f"/api/v1/cvms/{cvm_id}")

    def enrollment_token(self, cvm_id: str) -> EnrollmentToken:
        """A one-time token for the CVM's launch data (admins): it enrolls with it."""
        return self._model(
            EnrollmentToken, "POST", f"/api/v1/cvms/{cvm_id}/enrollment-token", ok=(201,)
        )

    def security_replica_token(self, team: str, replica: int) -> SecurityReplicaToken:
        """Register replica `replica` of the team's Security CVM pool (admins) and mint its
        one-time token, for the team stack's Pulumi secret config."""
        return self._model(
            SecurityReplicaToken,
            "POST",
            f"/api/v1/teams/{team}/security-replicas/{replica}/enrollment-token",
            ok=(201,),
        )

    def rotate_credential(self, cvm_id: str) -> CvmCreated:
        return self._model(CvmCreated, "POST", f"/api/v1/cvms/{cvm_id}/credential")

    # secrets (write-only)
    def deactivate_user(self, team: str, subject: str) -> Deactivated:
        return self._model(
            Deactivated,
            "POST",
            f"/api/v1/teams/{team}/members/{quote(subject, safe='')}/deactivate",
        )

    def reactivate_user(self, team: str, subject: str) -> Reactivated:
        return self._model(
            Reactivated,
            "POST",
            f"/api/v1/teams/{team}/members/{quote(subject, safe='')}/reactivate",
        )

    def set_team_secret(
        self,
        team: str,
        name: str,
        value: str,
        hosts: list[str] | None = None,
        *,
        if_version: int | None = None,
        kind: str = "static",
    ) -> SecretInfo:
        """`if_version`: store only if the secret is still at that version (else 412). A `kind`
        other than static sends the kind's JSON document as `value`."""
        body = {"value": value, "hosts": hosts or [], "kind": kind}
        return self._model(
            SecretInfo,
            "PUT",
            f"/api/v1/teams/{team}/secrets/{name}",
            json=body,
            headers=_if_version(if_version),
        )

    def set_personal_secret(
        self,
        team: str,
        name: str,
        value: str,
        hosts: list[str],
        *,
        if_version: int | None = None,
        kind: str = "static",
    ) -> SecretInfo:
        body = {"value": value, "hosts": hosts, "kind": kind}
        return self._model(
            SecretInfo,
            "PUT",
            f"/api/v1/teams/{team}/personal-secrets/{name}",
            json=body,
            headers=_if_version(if_version),
        )

    def list_secrets(self, team: str, *, personal: bool = False) -> list[SecretInfo]:
        kind = "personal-secrets" if personal else "secrets"
        response = self._request("GET", f"/api/v1/teams/{team}/{kind}")
        return [SecretInfo.model_validate(item) for item in response.json()]

    def delete_secret(self, team: str, name: str, *, personal: bool = False) -> None:
        kind = "personal-secrets" if personal else "secrets"
        self._request("DELETE", f"/api/v1/teams/{team}/{kind}/{name}", ok=(204,))

    # logs
    def traffic(
        self,
        team: str,
        *,
        cvm_id: str | None = None,
        owner: str | None = None,
        host: str | None = None,
        decision: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 100,
        cursor: str | None = None,
        reason: str | None = None,
        rule_id: str | None = None,
    ) -> TrafficPage:
        params = {
            "cvm_id": cvm_id,
            "owner": owner,
            "host": host,
            "decision": decision,
            "reason": reason,
            "rule_id": rule_id,
            "since": since.isoformat() if since else None,
            "until": until.isoformat() if until else None,
            "limit": limit,
            "cursor": cursor,
        }
        query = {key: value for key, value in params.items() if value is not None}
        return self._model(TrafficPage, "GET", f"/api/v1/teams/{team}/traffic", params=query)

    def usage(
        self,
        team: str,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        owner: str | None = None,
        cvm_id: str | None = None,
    ) -> UsageReportOut:
        params = {
            "since": since.isoformat() if since else None,
            "until": until.isoformat() if until else None,
            "owner": owner,
            "cvm_id": cvm_id,
        }
        query = {key: value for key, value in params.items() if value is not None}
        return self._model(UsageReportOut, "GET", f"/api/v1/teams/{team}/usage", params=query)

    def quarantine(self, team: str, *, limit: int = 100) -> QuarantinePage:
        url = f"/api/v1/teams/{team}/traffic/quarantine"
        return self._model(QuarantinePage, "GET", url, params={"limit": limit})

    def audit(self, team: str, *, after: int = 0, limit: int = 100) -> AuditPage:
        params = {"after": after, "limit": limit}
        return self._model(AuditPage, "GET", f"/api/v1/teams/{team}/audit", params=params)
