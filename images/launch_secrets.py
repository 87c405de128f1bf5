"""Reading a Console VM's launch secrets with the VM's own identity (components.secret_refs).

GCP: an access token for the VM's service account from the metadata server (by address), then
Secret Manager's `versions/…:access`. Azure: a managed-identity token for Key Vault from IMDS,
then the secret's URI. Errors name the reference and the HTTP status, never a value or a token.
Not run against a real cloud (docs/specs/infra.md): the launch agent's tests use a stub reader."""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import httpx

from umbra.components.secret_refs import SecretStore, secret_store

# By address (the same reasons as the launch agent's metadata reads).
METADATA = "http://169.254.169.254"
SECRET_MANAGER_API = "https://secretmanager.googleapis.com"  # noqa: S105 (an endpoint)
KEY_VAULT_RESOURCE = "https://vault.azure.net"
KEY_VAULT_API = "7.4"


class SecretReadError(Exception):
    """A secret could not be read; the message names the reference, never a value. `retryable`:
    what a fresh grant looks like while it propagates (401/403/404), throttling, 5xx, no route."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


# A grant made with the VM (Azure's role assignment needs the VM's identity first) takes minutes
# to propagate: about 5 minutes of retries before the launch is refused.
RETRY_DELAYS = (5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0, 60.0)
_RETRY_STATUS = frozenset({401, 403, 404, 429, 500, 502, 503, 504})


def _status_error(ref: str, exc: httpx.HTTPStatusError) -> SecretReadError:
    code = exc.response.status_code
    return SecretReadError(f"{ref}: HTTP {code}", retryable=code in _RETRY_STATUS)


@contextmanager
def _read_errors(ref: str) -> Iterator[None]:
    """What reading `ref` raises, as a SecretReadError naming the reference (and the HTTP
    status), never a value; no route or a timeout is retryable."""
    try:
        yield
    except httpx.HTTPStatusError as exc:
        raise _status_error(ref, exc) from None
    except httpx.TransportError as exc:
        raise SecretReadError(f"{ref}: {type(exc).__name__}", retryable=True) from None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise SecretReadError(f"{ref}: {type(exc).__name__}") from None


class SecretReader(Protocol):
    def read(self, ref: str) -> str: ...


def _token(r: httpx.Response, what: str) -> str:
    try:
        r.raise_for_status()
        token = r.json()["access_token"]
    except httpx.HTTPStatusError as exc:
        raise _status_error(what, exc) from None
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise SecretReadError(f"{what}: no access token ({type(exc).__name__})") from None
    if not isinstance(token, str) or not token:
        raise SecretReadError(f"{what}: no access token")
    return token


@dataclass(frozen=True)
class GcpSecretManager:
    metadata: str = METADATA
    api: str = SECRET_MANAGER_API
    timeout: float = 10

    def read(self, ref: str) -> str:
        if secret_store(ref) != SecretStore.GCP_SECRET_MANAGER:
            raise SecretReadError(f"{ref}: not a Secret Manager version")
        with _read_errors(ref):
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


@dataclass(frozen=True)
class AzureKeyVault:
    imds: str = METADATA
    timeout: float = 10

    def read(self, ref: str) -> str:
        if secret_store(ref) != SecretStore.AZURE_KEY_VAULT:
            raise SecretReadError(f"{ref}: not a Key Vault secret URI")
        with _read_errors(ref):
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
        if not isinstance(value, str):
            raise SecretReadError(f"{ref}: the secret's value is not a string")
        return value


@dataclass(frozen=True)
class Retrying:
    """Retries a retryable read with `delays` between attempts; then the last error, naming how
    many attempts were made (never a value)."""

    reader: SecretReader
    delays: Sequence[float] = RETRY_DELAYS
    sleep: Callable[[float], None] = time.sleep
    say: Callable[[str], None] = lambda _line: None

    def read(self, ref: str) -> str:
        for attempt, delay in enumerate((*self.delays, None), 1):
            try:
                return self.reader.read(ref)
            except SecretReadError as exc:
                if not exc.retryable or delay is None:
                    raise SecretReadError(f"{exc} (after {attempt} attempts)") from None
                self.say(f"umbra-launch: {exc}; retrying in {delay:g} s")
                self.sleep(delay)
        raise AssertionError("unreachable")
