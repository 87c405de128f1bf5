"""What minting can fail with, and the Console side of a rotating chain, shared by the minter
(`proxy/minting.py`), its token dialer and its Console client."""

from __future__ import annotations

from typing import Protocol

from umbra.proxy.secrets import SecretKey


class MintError(Exception):
    """A token could not be had; the message never holds a secret or a response body."""


class CredentialRefused(MintError):
    """The token endpoint refused the credential: a new login is needed."""


class CredentialUnavailable(MintError):
    """The token endpoint was slow, down or answered nonsense; retried after a hold."""


class LeaseBusy(Exception):
    """Another replica is refreshing this chain, or the Console holds a newer version."""


class RefreshPersister(Protocol):
    """The Console side of a rotating chain (`umbra.contracts.secret_refresh`)."""

    async def lease(self, key: SecretKey, version: int) -> str: ...
    async def commit(self, key: SecretKey, version: int, lease: str, document: str) -> int: ...
    async def failure(
        self, key: SecretKey, version: int, lease: str, refused: bool, detail: str
    ) -> None: ...
