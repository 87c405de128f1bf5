"""Where a Console VM's launch secrets live: references, never values.

The Console VM's database password and TLS private key are stored in the cloud's secret store by
the Console stack and read at boot by the launch agent with the VM's own identity (GCP: Secret
Manager, the VM's service account holding `secretAccessor` on exactly those secrets; Azure: Key
Vault with RBAC, the VM's system identity holding `Key Vault Secrets User` on that vault). Launch
data carries only the reference (a resource name or URI), so the values are absent from instance
metadata listings, user data, the event log and the stack's plain outputs. See docs/specs/infra.md
"The Console VM's launch". Shared by the stack (which renders references) and the launch agent
(which checks them against the cloud it runs on)."""

from __future__ import annotations

import re
from enum import StrEnum


class SecretStore(StrEnum):
    GCP_SECRET_MANAGER = "gcp-secret-manager"  # noqa: S105 (a store's name)
    AZURE_KEY_VAULT = "azure-key-vault"


# `projects/<project id or number>/secrets/<id>/versions/<n|latest>` (SecretVersion.name).
_GCP = re.compile(
    r"^projects/[a-z0-9-]{1,63}/secrets/[A-Za-z0-9_-]{1,255}/versions/(?:latest|[0-9]{1,10})$"
)
# `https://<vault>.vault.azure.net/secrets/<name>[/<version>]` (Secret.properties.secretUri*).
_AZURE = re.compile(
    r"^https://[A-Za-z0-9-]{3,24}\.vault\.azure\.net/secrets/[A-Za-z0-9-]{1,127}(?:/[0-9a-f]{32})?$"
)
CLOUD_STORE = {"gcp": SecretStore.GCP_SECRET_MANAGER, "azure": SecretStore.AZURE_KEY_VAULT}


def secret_store(ref: str) -> SecretStore:
    """The store a reference names; ValueError if it is neither shape (the ref is no secret)."""
    if _GCP.match(ref):
        return SecretStore.GCP_SECRET_MANAGER
    if _AZURE.match(ref):
        return SecretStore.AZURE_KEY_VAULT
    raise ValueError(f"{ref!r} is neither a Secret Manager version nor a Key Vault secret URI")
