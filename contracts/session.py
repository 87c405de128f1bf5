"""What the developer's client learns from the Console about one Dev CVM before an SSH session.

The Console serves it (`GET /api/v1/cvms/{id}/session`) and `umbra ssh-proxy` parses it; none of
it is trusted on its own: the client checks every item against the Dev CVM's quote (see
docs/specs/session.md). Defined once here so both ends agree on fields and limits; the document
itself, `SessionInfo`, names an attestation type and so lives in `umbra.attest.session_info`.
"""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import Field

from umbra.contracts.model import Strict

SESSION_API = "/api/v1/cvms/{cvm_id}/session"
CVM_ID_EVENT = "umbra.cvm-id"
SSH_HOST_KEY_EVENT = "umbra.ssh-host-key"
# 16 random bytes (hex) chosen at each boot by whoever binds the host key: a client refuses a
# host key that differs from its pin for the same CVM id and boot (docs/specs/session.md).
BOOT_ID_EVENT = "umbra.boot-id"
# Payload: SHA-256 of the nftables ruleset a cloud Dev CVM's launch agent loaded at boot.
HOST_FIREWALL_EVENT = "umbra.host-firewall"
# A Console VM's launch-bound configuration (components.launch_data.console_launch_digest).
CONSOLE_LAUNCH_EVENT = "umbra.console-launch"
# The gateway sshd's login name; its ForceCommand drops to the sandbox user inside the sandbox.
LOGIN_USER = "root"
_HOST = r"^[A-Za-z0-9]([A-Za-z0-9.:-]{0,251}[A-Za-z0-9])?$"


class SessionState(enum.StrEnum):
    running = "running"
    stopped = "stopped"
    other = "other"


class SshIngress(Strict):
    """Where the Dev CVM's attested SSH ingress listens (an address, not a trust anchor)."""

    host: Annotated[str, Field(pattern=_HOST)]
    port: int = Field(ge=1, le=65535)
