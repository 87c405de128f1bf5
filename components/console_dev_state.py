"""Where the Dev CVM stacks the Console runs (Automation API, one stack per Dev CVM) keep their
state and encrypt their secrets: a private, versioned bucket and a KMS key on GCP; a blob
container without shared keys and a Key Vault key on Azure. The Console's identity may use
these resources only (components/console_service.py grants it)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import pulumi

if TYPE_CHECKING:
    from umbra.components.console_service import ConsoleServiceArgs

# The Console's service account encrypts and decrypts the Dev CVM stacks' secrets with the key.
KMS_ROLE = "roles/cloudkms.cryptoKeyEncrypterDecrypter"


def dev_state_names(project: str, region: str, name: str) -> tuple[str, str, str, str]:
    """(bucket, key ring, key, secrets provider URL): fixed names, so the Console's settings
    can be written before `up` and a re-run finds the same resources."""
    bucket = f"{project}-umbra-{name}-state"
    ring, key = f"umbra-{name}", "dev-cvm-stacks"
    provider = f"gcpkms://projects/{project}/locations/{region}/keyRings/{ring}/cryptoKeys/{key}"
    return bucket, ring, key, provider


def gcp_dev_state(
    name: str, args: ConsoleServiceArgs, member: pulumi.Input[str], opts: pulumi.ResourceOptions
) -> pulumi.Output[str]:
    """The Dev CVM stacks' state bucket (private, versioned: a bad run's state can be restored)
    and the KMS key encrypting their secrets; the Console's identity may use the key only."""
    import pulumi_gcp as gcp

    assert args.gcp is not None
    project, region = args.gcp.project, args.gcp.region
    bucket_name, ring_name, key_name, _ = dev_state_names(project, region, args.name)
    bucket = gcp.storage.Bucket(
        f"{name}-dev-state",
        name=bucket_name,
        project=project,
        location=region.upper(),
        uniform_bucket_level_access=True,
        public_access_prevention="enforced",
        versioning=gcp.storage.BucketVersioningArgs(enabled=True),
        force_destroy=False,
        opts=opts,
    )
    ring = gcp.kms.KeyRing(
        f"{name}-dev-state-ring", name=ring_name, project=project, location=region, opts=opts
    )
    key = gcp.kms.CryptoKey(
        f"{name}-dev-state-key",
        name=key_name,
        key_ring=ring.id,
        purpose="ENCRYPT_DECRYPT",
        rotation_period=f"{90 * 24 * 3600}s",
        # Destroying the key would make every stack's secrets unreadable.
        opts=pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(protect=True)),
    )
    gcp.kms.CryptoKeyIAMMember(
        f"{name}-dev-state-key-user", crypto_key_id=key.id, role=KMS_ROLE, member=member, opts=opts
    )
    return bucket.name


# Key Vault Crypto User (built-in, fixed id): use a vault's keys (encrypt, decrypt, wrap).
AZURE_KEY_VAULT_CRYPTO_USER = "12338af0-0e69-4776-bea7-57ae8d297424"
DEV_STATE_CONTAINER = "dev-cvm-stacks"
DEV_STATE_KEY = "dev-cvm-stacks"


def azure_dev_state_account(stack_name: str, subscription: str) -> str:
    """A storage account name: global, 3-24 lowercase letters and digits, fixed per
    deployment so the Console's settings can be written before `up`."""
    digest = hashlib.sha256(f"{subscription}/{stack_name}".encode()).hexdigest()
    return f"umbrast{digest[:12]}"


def azure_dev_state(
    name: str, args: ConsoleServiceArgs, rg: pulumi.Input[str], opts: pulumi.ResourceOptions
) -> tuple[pulumi.Output[str], pulumi.Output[str], pulumi.Output[str], pulumi.Output[str]]:
    """The Dev CVM stacks' state container (no shared keys, no public blobs) and a key in the
    Console's vault for their secrets. Returns (container id: the identities' Blob Data
    Contributor scope, key id, backend URL, secrets provider URL)."""
    import pulumi_azure_native as azure

    from umbra.components.console_secrets import azure_key_vault_name

    assert args.azure is not None
    sub = azure.authorization.get_client_config_output().subscription_id
    account_name = sub.apply(lambda s: azure_dev_state_account(args.name, s))
    vault_name = sub.apply(lambda s: azure_key_vault_name(args.name, s))
    account = azure.storage.StorageAccount(
        f"{name}-dev-state",
        account_name=account_name,
        resource_group_name=rg,
        location=args.azure.location,
        kind="StorageV2",
        sku=azure.storage.SkuArgs(name="Standard_ZRS"),
        allow_blob_public_access=False,
        # Identities only (the Console's managed identity): no account keys, no SAS.
        allow_shared_key_access=False,
        minimum_tls_version="TLS1_2",
        enable_https_traffic_only=True,
        opts=opts,
    )
    container = azure.storage.BlobContainer(
        f"{name}-dev-state-container",
        container_name=DEV_STATE_CONTAINER,
        account_name=account.name,
        resource_group_name=rg,
        public_access=azure.storage.PublicAccess.NONE,
        opts=opts,
    )
    key = azure.keyvault.Key(
        f"{name}-kv-dev-state",
        key_name=DEV_STATE_KEY,
        vault_name=vault_name,
        resource_group_name=rg,
        properties=azure.keyvault.KeyPropertiesArgs(
            kty="RSA", key_size=3072, key_ops=["encrypt", "decrypt", "wrapKey", "unwrapKey"]
        ),
        # Deleting it makes every Dev CVM stack's secrets unreadable.
        opts=pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(protect=True)),
    )
    backend = pulumi.Output.format(
        "azblob://{0}?storage_account={1}", DEV_STATE_CONTAINER, account_name
    )
    provider = pulumi.Output.format(
        "azurekeyvault://{0}.vault.azure.net/keys/{1}", vault_name, DEV_STATE_KEY
    )
    return container.id, key.id, backend, provider
