"""`SessionInfo`: one Dev CVM as the developer's SSH client needs it (`GET /api/v1/cvms/{id}/session`).

The Console serves it and `umbra ssh-proxy` parses it; none of it is trusted on its own word: the
client checks every item against the Dev CVM's quote (docs/specs/session.md). It lives here, not in
`umbra.contracts.session` (its names and limits), because it carries the release manifest, an
attestation type, and `umbra.contracts` imports nothing of Umbra's.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from umbra.attest.measurement import ReleaseManifest, canonical_ssh_key
from umbra.contracts.model import Strict
from umbra.contracts.session import SessionState, SshIngress


class SessionInfo(Strict):
    """One Dev CVM as the SSH client needs it."""

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
