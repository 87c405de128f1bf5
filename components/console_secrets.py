"""The Console VM's launch secrets (its database password, TLS private key and web session key) in the cloud's
secret store, readable by the Console VM's identity alone; launch data carries only references
(components.secret_refs). Why a store and not the launch data itself: instance metadata and Azure
user data are readable by anyone who can read the VM (`compute.instances.get`, VM Reader) and are
listed by the clouds' consoles and CLIs; a secret store read by the VM's identity is not, and the
values stay Pulumi secrets (encrypted in state) on their way in. docs/specs/infra.md "The Console
VM's launch"."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

import pulumi


class ConsoleSecret(StrEnum):
    DATABASE_PASSWORD = "db-password"  # noqa: S105 (a secret's name)
    TLS_KEY = "tls-key"
    WEB_SESSION_KEY = "web-session-key"


GCP_SECRET_ACCESSOR = "roles/secretmanager.secretAccessor"  # noqa: S105 (a role)
# Azure built-in "Key Vault Secrets User" (read secret contents), fixed id.
AZURE_KEY_VAULT_SECRETS_USER = "4633458b-17de-408a-b874-0445c86b69e6"


def gcp_console_secrets(
    name: str,
    stack_name: str,
    project: str,
    member: pulumi.Input[str],
    values: Mapping[ConsoleSecret, pulumi.Input[str]],
    opts: pulumi.ResourceOptions,
) -> tuple[dict[ConsoleSecret, pulumi.Output[str]], list[pulumi.Resource]]:
    """One Secret Manager secret per value, its version, and `secretAccessor` on that secret (not
    the project) for the Console's service account. Returns each version's resource name (the
    launch reference) and the grants (the VM waits for them: its first boot reads the secrets)."""
    import pulumi_gcp as gcp

    refs: dict[ConsoleSecret, pulumi.Output[str]] = {}
    grants: list[pulumi.Resource] = []
    for kind, value in values.items():
        secret = gcp.secretmanager.Secret(
            f"{name}-{kind}",
            secret_id=f"umbra-{stack_name}-{kind}",
            project=project,
            replication=gcp.secretmanager.SecretReplicationArgs(
                auto=gcp.secretmanager.SecretReplicationAutoArgs()
            ),
            opts=opts,
        )
        version = gcp.secretmanager.SecretVersion(
            f"{name}-{kind}-version",
            secret=secret.id,
            secret_data=pulumi.Output.secret(value),
            opts=opts,
        )
        grants.append(
            gcp.secretmanager.SecretIamMember(
                f"{name}-{kind}-reader",
                project=project,
                secret_id=secret.secret_id,
                role=GCP_SECRET_ACCESSOR,
                member=member,
                opts=opts,
            )
        )
        refs[kind] = version.name
    return refs, grants


def azure_key_vault_name(stack_name: str, subscription: str) -> str:
    """3-24 characters, globally unique: the stack's name and the subscription's first hex."""
    return f"umbra-{stack_name[:9]}-{subscription.replace('-', '')[:8]}"


def azure_console_secrets(
    name: str,
    stack_name: str,
    resource_group: pulumi.Input[str],
    location: str,
    values: Mapping[ConsoleSecret, pulumi.Input[str]],
    opts: pulumi.ResourceOptions,
) -> tuple[dict[ConsoleSecret, pulumi.Output[str]], pulumi.Output[str]]:
    """A Key Vault with RBAC authorization (no access policies: nobody reads it by default), one
    secret per value. Returns each secret's versioned URI (the launch reference) and the vault's
    id, the scope of the Console identity's `Key Vault Secrets User` (azure_console_reader)."""
    import pulumi_azure_native as azure

    client = azure.authorization.get_client_config_output()
    vault = azure.keyvault.Vault(
        f"{name}-kv",
        vault_name=client.subscription_id.apply(lambda s: azure_key_vault_name(stack_name, s)),
        resource_group_name=resource_group,
        location=location,
        properties=azure.keyvault.VaultPropertiesArgs(
            tenant_id=client.tenant_id,
            sku=azure.keyvault.SkuArgs(
                family=azure.keyvault.SkuFamily.A, name=azure.keyvault.SkuName.STANDARD
            ),
            enable_rbac_authorization=True,
            enable_purge_protection=True,
        ),
        opts=opts,
    )
    refs: dict[ConsoleSecret, pulumi.Output[str]] = {}
    for kind, value in values.items():
        secret = azure.keyvault.Secret(
            f"{name}-kv-{kind}",
            secret_name=kind.value,
            vault_name=vault.name,
            resource_group_name=resource_group,
            properties=azure.keyvault.SecretPropertiesArgs(value=pulumi.Output.secret(value)),
            opts=opts,
        )
        # The URI is no secret (the `properties` it comes from are, as a whole, for `value`):
        # launch data and its diffs stay readable.
        refs[kind] = pulumi.Output.unsecret(
            secret.properties.apply(lambda p: p.secret_uri_with_version or "")
        )
    return refs, vault.id


def azure_console_reader(
    name: str,
    principal_id: pulumi.Input[str],
    vault_id: pulumi.Input[str],
    opts: pulumi.ResourceOptions,
) -> None:
    """The Console VM's system identity reads the vault's secrets (exists only once the VM does:
    the launch agent's Key Vault reads retry while the assignment propagates)."""
    import pulumi_azure_native as azure

    sub = azure.authorization.get_client_config_output().subscription_id
    azure.authorization.RoleAssignment(
        f"{name}-kv-reader",
        principal_id=principal_id,
        principal_type="ServicePrincipal",
        role_definition_id=pulumi.Output.concat(
            "/subscriptions/",
            sub,
            "/providers/Microsoft.Authorization/roleDefinitions/",
            AZURE_KEY_VAULT_SECRETS_USER,
        ),
        scope=vault_id,
        opts=opts,
    )
