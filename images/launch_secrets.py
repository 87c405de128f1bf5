"""Reading a Console VM's launch secrets with the VM's own identity (components.secret_refs).

GCP: an access token for the VM's service account from the metadata server (by address), then
Secret Manager's `versions/…:access`. Azure: a managed-identity token for Key Vault from IMDS,
then the secret's URI. Errors name the reference and the HTTP status, never a value or a token.
Not run against a real cloud (docs/specs/infra.md): the launch agent's tests use a stub reader."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Protocol

import httpx

from umbra.components.secret_refs import SecretStore, secret_store

# By address (the same reasons as the launch agent's metadata reads).
METADATA = "http://169.254.169.254"
SECRET_MANAGER = "https://secretmanager.googleapis.com"
KEY_VAULT_RESOURCE = "https://vault.azure.net"
KEY_VAULT_API = "7.4"


class SecretReadError(Exception):
    """A secret could not be read; the message names the reference, never a value."""


class SecretReader(Protocol):
    def read(self, ref: str) -> str: ...


def _token(r: httpx.Response, what: str) -> str:
    try:
        r.raise_for_status()
        token = r.json()["access_token"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise SecretReadError(f"{what}: no access token ({type(exc).__name__})") from None
    if not isinstance(token, str) or not token:
        raise SecretReadError(f"{what}: no access token")
    return token


@dataclass(frozen=True)
class GcpSecretManager:
    metadata: str = METADATA
    api: str = SECRET_MANAGER
    timeout: float = 10

    def read(self, ref: str) -> str:
        if secret_store(ref) != SecretStore.GCP_SECRET_MANAGER:
            raise SecretReadError(f"{ref}: not a Secret Manager version")
        try:
            token = _token(
                httpx.get(
                    f"{self.metadata}/computeMetadata/v1/instance/service-accounts/default/token",
                    headers={"Metadata-Flavor": "Google"},
                    timeout=self.timeout,
                ),
                "GCP metadata token",
            )
            r = httpx.get(
                f"{self.api}/v1/{ref}:access",
                headers={"Authorization": f"Bearer {token}"},
                timeout=self.timeout,
            )
            r.raise_for_status()
            data = r.json()["payload"]["data"]
            return base64.b64decode(data, validate=True).decode()
        except httpx.HTTPStatusError as exc:
            raise SecretReadError(f"{ref}: HTTP {exc.response.status_code}") from None
        except (httpx.HTTPError, ValueError, KeyError, TypeError, binascii.Error) as exc:
            raise SecretReadError(f"{ref}: {type(exc).__name__}") from None


@dataclass(frozen=True)
class AzureKeyVault:
    imds: str = METADATA
    timeout: float = 10

    def read(self, ref: str) -> str:
        if secret_store(ref) != SecretStore.AZURE_KEY_VAULT:
            raise SecretReadError(f"{ref}: not a Key Vault secret URI")
        try:
            token = _token(
                httpx.get(
                    f"{self.imds}/metadata/identity/oauth2/token",
                    params={"api-version": "2018-02-01", "resource": KEY_VAULT_RESOURCE},
                    headers={"Metadata": "true"},
                    timeout=self.timeout,
                ),
                "Azure managed identity token",
            )
            r = httpx.get(
                ref,
                params={"api-version": KEY_VAULT_API},
                headers={"Authorization": f"Bearer {token}"},
                timeout=self.timeout,
            )
            r.raise_for_status()
            value = r.json()["value"]
        except httpx.HTTPStatusError as exc:
            raise SecretReadError(f"{ref}: HTTP {exc.response.status_code}") from None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise SecretReadError(f"{ref}: {type(exc).__name__}") from None
        if not isinstance(value, str):
            raise SecretReadError(f"{ref}: the secret's value is not a string")
        return value
