"""What the developer's client learns from the Console about one Dev CVM before an SSH session.

The Console serves it (`GET /api/v1/cvms/{id}/session`) and `umbra ssh-proxy` parses it; none of
it is trusted on its own: the client checks every item against the Dev CVM's quote (see
docs/specs/session.md). Defined once here so both ends agree on fields and limits.
"""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from umbra.attest.measurement import ReleaseManifest, canonical_ssh_key

SESSION_API = "/api/v1/cvms/{cvm_id}/session"
CVM_ID_EVENT = "umbra.cvm-id"
SSH_HOST_KEY_EVENT = "umbra.ssh-host-key"
# 16 random bytes (hex) chosen at each boot by whoever binds the host key: a client refuses a
# host key that differs from its pin for the same CVM id and boot (docs/specs/session.md).
BOOT_ID_EVENT = "umbra.boot-id"
# Payload: SHA-256 of the nftables ruleset a cloud Dev CVM's launch agent loaded at boot.
HOST_FIREWALL_EVENT = "umbra.host-firewall"
# The gateway sshd's login name; its ForceCommand drops to the sandbox user inside the sandbox.
LOGIN_USER = "root"
_HOST = r"^[A-Za-z0-9]([A-Za-z0-9.:-]{0,251}[A-Za-z0-9])?$"


class SessionState(enum.StrEnum):
    running = "running"
    stopped = "stopped"
    other = "other"


class SshIngress(BaseModel):
    """Where the Dev CVM's attested SSH ingress listens (an address, not a trust anchor)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: Annotated[str, Field(pattern=_HOST)]
    port: int = Field(ge=1, le=65535)


class SessionInfo(BaseModel):
    """One Dev CVM as the SSH client needs it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cvm_id: str = Field(pattern=r"^[A-Za-z0-9._-]{1,128}$")
    name: str
    state: SessionState
    ingress: SshIngress | None
    release: ReleaseManifest | None
    ssh_authorized_keys: list[str] = Field(default_factory=list, max_length=32)
    # A cloud Dev CVM's launch-bound host firewall (LaunchData.expected_events()'s
    # umbra.host-firewall: SHA-256 of the ruleset, hex); None where none was launched.
    host_firewall_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @field_validator("ssh_authorized_keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        return [canonical_ssh_key(k) for k in keys]
