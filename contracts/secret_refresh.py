"""The write-back of a rotated refresh token, from a Security CVM to the Console, defined once.

A rotating refresh token (ChatGPT-style: every refresh answers a new one and voids the old) is a
chain: two replicas spending the same token at once break it. So a refresh is leased: a replica
asks the Console for the lease on (secret, version); only one holder at a time gets it. The holder
spends the refresh token, then commits the new document conditional on (version, lease): the
Console stores it as version + 1 and every replica receives it by the next release. A refusal by
the token endpoint is reported with the same lease and marks the secret as needing a new login.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from umbra.contracts.model import Strict
from umbra.contracts.secret_kinds import MAX_MATERIAL_BYTES

SECRET_REF_PATTERN = r"^(team|personal)/[a-z0-9](?:[a-z0-9._-]{0,126}[a-z0-9])?$"  # noqa: S105 (a pattern)
LEASE_PATTERN = r"^[A-Za-z0-9_-]{16,64}$"


class SecretAt(Strict):
    """One secret at one version, as released: `owner` is None for a team secret."""

    ref: str = Field(pattern=SECRET_REF_PATTERN)
    owner: str | None = Field(default=None, max_length=255)
    version: int = Field(ge=1)


class LeaseGrant(Strict):
    lease: str = Field(pattern=LEASE_PATTERN)
    until: datetime
    version: int


class RefreshCommit(SecretAt):
    lease: str = Field(pattern=LEASE_PATTERN)
    # The new oauth2-refresh document (the rotated refresh token and the access token it came
    # with), sent over the Security CVM's attested channel and sealed by the Console at once.
    document: str = Field(min_length=2, max_length=MAX_MATERIAL_BYTES, repr=False)


class RefreshCommitted(Strict):
    version: int


class RefreshFailure(SecretAt):
    lease: str = Field(pattern=LEASE_PATTERN)
    # True: the token endpoint refused the refresh token (invalid_grant): the secret needs a new
    # login. False: the endpoint was slow or down; only the lease is given back.
    refused: bool
    detail: str = Field(default="", max_length=200)
