"""What the Console asks for: the team's target, one Dev CVM's spec and what its stack exports;
each refused at construction with a message safe to show to the Console's caller."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from umbra.attest.measurement import canonical_ssh_key
from umbra.components.config import AzurePlacement, GcpPlacement
from umbra.components.network import Cloud

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,14}[a-z0-9]$")


class ProvisionerError(Exception):
    """Launch/update/destroy failed; the message is safe to show to the Console's caller."""


@dataclass(frozen=True)
class TeamTarget:
    """Where a team lives: its team stack (for network outputs) and its placement."""

    team: str
    cloud: Cloud
    # Fully qualified team stack, e.g. "acme-org/umbra/acme-gcp", read by StackReference.
    team_stack: str
    gcp: GcpPlacement | None = None
    azure: AzurePlacement | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.team):
            raise ProvisionerError(f"team {self.team!r} is not a valid name")
        if (self.cloud == "gcp") != (self.gcp is not None) or (self.cloud == "azure") != (
            self.azure is not None
        ):
            raise ProvisionerError(
                f"team {self.team!r}: placement does not match cloud {self.cloud!r}"
            )

    def as_doc(self) -> dict[str, Any]:
        """As the stack's own config keeps it (stop/start re-runs the program from it)."""
        return {
            "team": self.team,
            "cloud": self.cloud,
            "team_stack": self.team_stack,
            "gcp": self.gcp.model_dump() if self.gcp else None,
            "azure": self.azure.model_dump() if self.azure else None,
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> TeamTarget:
        return cls(
            team=doc["team"],
            cloud=doc["cloud"],
            team_stack=doc["team_stack"],
            gcp=GcpPlacement(**doc["gcp"]) if doc.get("gcp") else None,
            azure=AzurePlacement(**doc["azure"]) if doc.get("azure") else None,
        )


@dataclass(frozen=True)
class DevCvmSpec:
    """One Dev CVM as the Console asks for it. app_compose is the release's app-compose.json
    (`umbra image measure --out`); measurement_manifest is the release manifest URL or `sha256:`
    digest; cvm_id is the Console's id, the `umbra.cvm-id` event payload."""

    developer: str
    cvm: str
    ssh_authorized_keys: tuple[str, ...]
    size: str
    image: str
    app_compose: str
    measurement_manifest: str | None = None
    disk_gb: int = 50
    cvm_id: str | None = None
    data_disk_gb: int = 100
    # The Console's one-time enrollment token for the launch data (kept as a Pulumi secret).
    enrollment_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # From JSON (the stack's own config) the keys arrive as a list.
        object.__setattr__(self, "ssh_authorized_keys", tuple(self.ssh_authorized_keys))
        for what, value in (("developer", self.developer), ("cvm", self.cvm)):
            if not _NAME.match(value):
                raise ProvisionerError(f"{what} {value!r} is not a valid name (a-z, 0-9, -; 2-16)")
        if not self.ssh_authorized_keys:
            raise ProvisionerError(f"developer {self.developer!r} has no SSH keys")
        for key in self.ssh_authorized_keys:
            try:
                canonical_ssh_key(key)
            except ValueError as exc:
                raise ProvisionerError(f"ssh_authorized_keys: {exc}") from None
        try:
            doc = json.loads(self.app_compose)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("docker_compose_file"), str):
            raise ProvisionerError(
                "app_compose is not an app-compose.json document (JSON with docker_compose_file)"
            )


@dataclass(frozen=True)
class DevCvmOutputs:
    stack: str
    instance_id: str
    private_ip: str
    compose_sha256: str
    ssh_keys_sha256: str
    expected_events: Mapping[str, str]

    @classmethod
    def from_stack(cls, stack: str, outputs: Mapping[str, Any]) -> DevCvmOutputs:
        """From an `up`'s outputs; a missing one is the program's fault, named."""

        def value(key: str) -> Any:
            if key not in outputs:
                raise ProvisionerError(f"stack {stack} has no output {key!r}")
            return outputs[key].value

        return cls(
            stack=stack,
            instance_id=str(value("instance_id")),
            private_ip=str(value("private_ip")),
            compose_sha256=str(value("compose_sha256")),
            ssh_keys_sha256=str(value("ssh_keys_sha256")),
            expected_events=dict(value("expected_events")),
        )
