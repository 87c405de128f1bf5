"""ConsoleService: the Console in a TDX CVM (it holds write-only secrets) plus managed PostgreSQL
reachable only on a private address. One per deployment, not per team: team stacks name its URL.

Why one module: one ComponentResource whose two clouds' bases (network, database, identity and
its grants, the VM or the replicas) are built side by side so that each resource of one cloud
has its counterpart in view; the separable concerns live beside it (console_secrets,
console_pool, console_dev_state).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import pulumi

from umbra.components.config import AzurePlacement, GcpPlacement
from umbra.components.console_dev_state import (
    AZURE_KEY_VAULT_CRYPTO_USER,
    azure_dev_state,
    dev_state_names,
    gcp_dev_state,
)
from umbra.components.console_secrets import (
    ConsoleSecret,
    azure_console_reader,
    azure_console_secrets,
    gcp_console_secrets,
)
from umbra.components.cvm import CvmArgs, Placement, VmParts, VmSpec
from umbra.components.launch_data import DATABASE_CA_PATH, LaunchData
from umbra.components.network import Cloud
from umbra.components.ports import ROLE_CONSOLE, ROLE_LABEL

CONSOLE_PORT = 443
DB_NAME = "umbra"
DB_USER = "umbra_console"


@dataclass(frozen=True)
class ConsoleServiceArgs:
    name: str
    cloud: Cloud
    cidr: str
    ingress_cidrs: Sequence[str]
    vm_size: str
    vm_image: str
    console_image: str
    app_compose: pulumi.Input[str]
    db_tier: str
    db_password: pulumi.Input[str]
    db_storage_gb: int = 64  # bounds: components/config.py ConsoleStack.db_storage_gb
    gcp: GcpPlacement | None = None
    azure: AzurePlacement | None = None
    # GCP: where the provisioner launches Dev CVMs (default: this project) and the state bucket.
    team_projects: Sequence[str] = ()
    state_bucket: str | None = None
    # Azure: the team resource groups the provisioner launches into (default: the Console's
    # own) and the resource id of the state's storage account or container.
    team_resource_groups: Sequence[str] = ()
    state_scope: pulumi.Input[str] | None = None
    # The Console's TLS certificate chain (PEM, measured in its launch data) and private key (a
    # secret: stored in the cloud's secret store, never in launch data). Both or neither; without
    # them the Console VM's launch agent refuses to start it.
    tls_cert: str | None = None
    tls_key: pulumi.Input[str] | None = None
    # The Console's WEB_SESSION_KEY (a secret, stored like the TLS key): every replica keys its
    # cookies with it. Required for replicas > 1 (components/config.py checks the stack's config).
    web_session_key: pulumi.Input[str] | None = None
    # >1: replicas behind a passthrough load balancer on the static address (console_pool.py).
    replicas: int = 1
    # GCP: declare the Dev CVM stacks' state bucket and secrets-provider key (dev_state_names).
    dev_state: bool = False


# Exactly what the Dev CVM provisioner does on GCP: create/delete/stop instances and their disks
# (compute.instanceAdmin.v1), attach the team's Dev service account to them
# (iam.serviceAccountUser), and read/write stack state in the bucket (storage.objectAdmin).
PROVISIONER_PROJECT_ROLES = ("roles/compute.instanceAdmin.v1", "roles/iam.serviceAccountUser")
PROVISIONER_BUCKET_ROLE = "roles/storage.objectAdmin"
# Azure built-in roles (fixed ids): Virtual Machine Contributor covers VMs, their disks and
# NICs and joining a subnet; Storage Blob Data Contributor covers the Pulumi state blobs.
AZURE_VM_CONTRIBUTOR = "9980e02c-c2be-4d73-94e8-173b1dc7cf3c"
AZURE_BLOB_DATA_CONTRIBUTOR = "ba92f5b4-2d11-453d-a403-e96b0029c9fe"
CONSOLE_APIS = (
    "compute.googleapis.com",
    "iam.googleapis.com",
    "secretmanager.googleapis.com",
    "servicenetworking.googleapis.com",
    "sqladmin.googleapis.com",
)


DEV_STATE_APIS = ("cloudkms.googleapis.com", "storage.googleapis.com")


def _halves(cidr: str) -> tuple[str, str]:
    vm, db = ipaddress.IPv4Network(cidr).subnets(prefixlen_diff=1)
    return str(vm), str(db)


class ConsoleService(pulumi.ComponentResource):
    private_ip: pulumi.Output[str]
    public_ip: pulumi.Output[str] | None
    database_host: pulumi.Output[str]
    database_url: pulumi.Output[str]
    database_ca_pem: pulumi.Output[str]

    def __init__(
        self, name: str, args: ConsoleServiceArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("umbra:infra:ConsoleService", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        password = pulumi.Output.secret(args.db_password)
        identity: pulumi.Output[str] | None
        values: dict[ConsoleSecret, pulumi.Input[str]] = {ConsoleSecret.DATABASE_PASSWORD: password}
        if args.tls_key is not None:
            values[ConsoleSecret.TLS_KEY] = pulumi.Output.secret(args.tls_key)
        if args.web_session_key is not None:
            values[ConsoleSecret.WEB_SESSION_KEY] = pulumi.Output.secret(args.web_session_key)
        vm_opts = child
        vault_id: pulumi.Output[str] | None = None
        key_id: pulumi.Output[str] | None = None
        self.dev_state_backend_url: pulumi.Output[str] | None = None
        self.dev_secrets_provider: pulumi.Output[str] | None = None
        if args.cloud == "gcp":
            assert args.gcp is not None
            subnet_id, network_id, identity, db_host, place, db_ca = _gcp_base(
                name, args, password, child
            )
            member = pulumi.Output.concat("serviceAccount:", identity)
            refs, grants = gcp_console_secrets(
                name, args.name, args.gcp.project, member, values, child
            )
            if args.dev_state:
                bucket, _, _, kms = dev_state_names(args.gcp.project, args.gcp.region, args.name)
                self.dev_state_backend_url = pulumi.Output.from_input(f"gs://{bucket}")
                self.dev_secrets_provider = pulumi.Output.from_input(kms)
            # Its first boot reads the secrets: the grants exist before the VM does.
            vm_opts = pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(depends_on=grants))
        else:
            subnet_id, identity, db_host, place = _azure_base(name, args, password, child)
            assert args.azure is not None and place.resource_group_name is not None
            db_ca = None  # Azure Flexible Server chains to public roots: the system store
            refs, vault_id = azure_console_secrets(
                name, args.name, place.resource_group_name, args.azure.location, values, child
            )
            if args.dev_state:
                scope, key_id, self.dev_state_backend_url, self.dev_secrets_provider = (
                    azure_dev_state(name, args, place.resource_group_name, child)
                )
                args = replace(args, state_scope=scope)
        cvm = CvmArgs(
            team=args.name,
            vm_name=f"umbra-{args.name}",
            placement=place,
            size=args.vm_size,
            image=args.vm_image,
            subnet_id=subnet_id,
            identity=identity,
            app_compose=args.app_compose,
            labels={ROLE_LABEL: ROLE_CONSOLE},
            api_access=True,
        )
        # Launch data names the database without its password, and the secrets by reference.
        launch_url = pulumi.Output.format(
            "postgresql://{0}@{1}:5432/{2}?sslmode=verify-full{3}",
            DB_USER,
            db_host,
            DB_NAME,
            f"&sslrootcert={DATABASE_CA_PATH}" if db_ca is not None else "",
        )
        launch = pulumi.Output.all(
            args.app_compose,
            db_ca,
            launch_url,
            refs[ConsoleSecret.DATABASE_PASSWORD],
            refs.get(ConsoleSecret.TLS_KEY),
            refs.get(ConsoleSecret.WEB_SESSION_KEY),
        ).apply(
            lambda v: LaunchData(
                role=ROLE_CONSOLE,
                team=args.name,
                cvm_id=f"umbra-{args.name}",
                app_compose=v[0],
                database_ca=v[1] or None,
                database_url=v[2],
                database_password_ref=v[3],
                console_tls_cert=args.tls_cert,
                console_tls_key_ref=v[4] or None,
                web_session_key_ref=v[5] or None,
            )
        )
        self.database_ca_pem = pulumi.Output.from_input(db_ca or "")
        spec = VmSpec(ROLE_CONSOLE, cvm, launch, private_ip=None, public_ip=True, ssh_keys=())
        parts: VmParts
        if args.replicas > 1 and args.cloud == "gcp":
            from umbra.components.console_pool import build_gcp_console_pool, gcp_static_address
            from umbra.components.gcp_vm import _region
            from umbra.components.naming import labels as make_labels

            assert args.gcp is not None and identity is not None
            labels = {**cvm.labels, **make_labels(args.name, ROLE_CONSOLE)}
            # The same resource (name, parent) the single VM's address is: scaling out keeps it.
            address = gcp_static_address(
                f"{name}-vm", cvm.vm_name, args.gcp.project, _region(args.gcp.zone), labels, vm_opts
            )
            build_gcp_console_pool(
                f"{name}-pool",
                prefix=cvm.vm_name,
                project=args.gcp.project,
                region=args.gcp.region,
                zone=args.gcp.zone,
                network_id=network_id,
                subnet_id=subnet_id,
                identity=identity,
                size=cvm.size,
                image=cvm.image,
                disk_gb=cvm.disk_gb,
                labels=labels,
                launch=launch,
                address=address,
                replicas=args.replicas,
                opts=vm_opts,
            )
            # The group names its instances; their private addresses are the subnet's.
            parts = VmParts(
                instance_id=pulumi.Output.from_input(""),
                private_ip=pulumi.Output.from_input(""),
                public_ip=address,
            )
        elif args.replicas > 1:
            assert vault_id is not None
            parts = _azure_replicas(name, args, cvm, launch, vault_id, key_id, child)
        elif args.cloud == "gcp":
            from umbra.components.gcp_vm import build_gcp_vm

            parts = build_gcp_vm(f"{name}-vm", spec, vm_opts)
        else:
            from umbra.components.azure_vm import build_azure_vm

            parts = build_azure_vm(f"{name}-vm", spec, vm_opts)
            assert vault_id is not None
            _azure_identity_roles(name, args, parts, vault_id, key_id, child)
        self.private_ip = parts.private_ip
        self.public_ip = parts.public_ip
        self.database_host = db_host
        # The URL embeds the password, so it is a secret output end to end.
        self.database_url = pulumi.Output.secret(
            pulumi.Output.format(
                "postgresql://{0}:{1}@{2}:5432/{3}?sslmode=verify-full{4}",
                DB_USER,
                password,
                db_host,
                DB_NAME,
                # The CA the stack delivers in launch data, not whatever the image trusts.
                f"&sslrootcert={DATABASE_CA_PATH}" if db_ca is not None else "",
            )
        )
        self.register_outputs(
            {
                "private_ip": self.private_ip,
                "public_ip": self.public_ip,
                "database_host": self.database_host,
                "database_url": self.database_url,
                "database_ca_pem": self.database_ca_pem,
            }
        )


def _azure_replicas(
    name: str,
    args: ConsoleServiceArgs,
    cvm: CvmArgs,
    launch: pulumi.Output[LaunchData],
    vault_id: pulumi.Output[str],
    key_id: pulumi.Output[str] | None,
    opts: pulumi.ResourceOptions,
) -> VmParts:
    """N Console VMs with the same launch data, their NICs in a public Standard load
    balancer's pool (no address of their own); each VM's identity gets the provisioner's
    roles and the vault reader. Replica 0 keeps the single VM's names."""
    from umbra.components.azure_vm import build_azure_vm
    from umbra.components.console_pool import build_azure_console_lb
    from umbra.components.naming import labels as make_labels

    assert args.azure is not None and cvm.placement.resource_group_name is not None
    pool, address = build_azure_console_lb(
        f"{name}-vm",
        vm_name=cvm.vm_name,
        resource_group=cvm.placement.resource_group_name,
        location=args.azure.location,
        zone=args.azure.zone,
        tags={**cvm.labels, **make_labels(args.name, ROLE_CONSOLE)},
        opts=opts,
    )
    first: VmParts | None = None
    for i in range(args.replicas):
        suffix = f"-{i}" if i else ""
        replica = ConsoleCvmArgs(
            **{f.name: getattr(cvm, f.name) for f in fields(cvm)}
            | {"vm_name": cvm.vm_name + suffix, "lb_backend_pool": pool}
        )
        spec = VmSpec(ROLE_CONSOLE, replica, launch, private_ip=None, public_ip=False, ssh_keys=())
        parts = build_azure_vm(f"{name}-vm{suffix}", spec, opts)
        _azure_identity_roles(f"{name}{suffix}", args, parts, vault_id, key_id, opts)
        first = first or parts
    assert first is not None
    return VmParts(
        instance_id=first.instance_id,
        private_ip=pulumi.Output.from_input(""),
        public_ip=address,
    )


@dataclass(frozen=True)
class ConsoleCvmArgs(CvmArgs):
    # Azure replicas: the public load balancer's backend pool the replica's NIC joins.
    lb_backend_pool: pulumi.Input[str] | None = None


def _gcp_base(
    name: str, args: ConsoleServiceArgs, password: pulumi.Output[str], opts: pulumi.ResourceOptions
) -> tuple[
    pulumi.Output[str],
    pulumi.Output[str],
    pulumi.Output[str],
    pulumi.Output[str],
    Placement,
    pulumi.Output[str],
]:
    import pulumi_gcp as gcp

    assert args.gcp is not None
    project, region = args.gcp.project, args.gcp.region
    vm_cidr, _ = _halves(args.cidr)
    # A fresh project: the APIs the Console stack calls, never switched off on destroy.
    services = [
        gcp.projects.Service(
            f"{name}-api-{api.split('.')[0]}",
            project=project,
            service=api,
            disable_on_destroy=False,
            opts=opts,
        )
        for api in CONSOLE_APIS + (DEV_STATE_APIS if args.dev_state else ())
    ]
    opts = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=services))
    vpc = gcp.compute.Network(
        f"{name}-vpc",
        name=f"umbra-{args.name}",
        project=project,
        auto_create_subnetworks=False,
        opts=opts,
    )
    subnet = gcp.compute.Subnetwork(
        f"{name}-subnet",
        name=f"umbra-{args.name}",
        project=project,
        region=region,
        network=vpc.id,
        ip_cidr_range=vm_cidr,
        opts=opts,
    )
    sa = gcp.serviceaccount.Account(
        f"{name}-sa", account_id=f"umbra-{args.name}", project=project, opts=opts
    )
    member = sa.email.apply(lambda e: f"serviceAccount:{e}")
    for target in args.team_projects or [project]:
        for role in PROVISIONER_PROJECT_ROLES:
            gcp.projects.IAMMember(
                f"{name}-{target}-{role.split('/')[1]}",
                project=target,
                role=role,
                member=member,
                opts=opts,
            )
    state_bucket: pulumi.Input[str] | None = args.state_bucket
    if args.dev_state:
        state_bucket = gcp_dev_state(name, args, member, opts)
    if state_bucket:
        gcp.storage.BucketIAMMember(
            f"{name}-state",
            bucket=state_bucket,
            role=PROVISIONER_BUCKET_ROLE,
            member=member,
            opts=opts,
        )
    gcp.compute.Firewall(
        f"{name}-https-in",
        name=f"umbra-{args.name}-https-in",
        project=project,
        network=vpc.id,
        direction="INGRESS",
        target_service_accounts=[sa.email],
        source_ranges=list(args.ingress_cidrs),
        allows=[gcp.compute.FirewallAllowArgs(protocol="tcp", ports=[str(CONSOLE_PORT)])],
        opts=opts,
    )
    # Private services access: Cloud SQL gets an address inside this VPC only.
    peering_range = gcp.compute.GlobalAddress(
        f"{name}-sql-range",
        name=f"umbra-{args.name}-sql",
        project=project,
        network=vpc.id,
        purpose="VPC_PEERING",
        address_type="INTERNAL",
        prefix_length=20,
        opts=opts,
    )
    psa = gcp.servicenetworking.Connection(
        f"{name}-psa",
        network=vpc.id,
        service="servicenetworking.googleapis.com",
        reserved_peering_ranges=[peering_range.name],
        opts=opts,
    )
    db = gcp.sql.DatabaseInstance(
        f"{name}-db",
        name=f"umbra-{args.name}",
        project=project,
        region=region,
        database_version="POSTGRES_16",
        deletion_protection=True,
        settings=gcp.sql.DatabaseInstanceSettingsArgs(
            tier=args.db_tier,
            # The size it is created with; Cloud SQL grows it when it fills (a full database
            # stops the Console), and `ignore_changes` below keeps a grown disk from making the
            # next `up` plan a replacement to "shrink" it back.
            disk_size=args.db_storage_gb,
            disk_autoresize=True,
            availability_type="REGIONAL",
            backup_configuration=gcp.sql.DatabaseInstanceSettingsBackupConfigurationArgs(
                enabled=True, point_in_time_recovery_enabled=True
            ),
            ip_configuration=gcp.sql.DatabaseInstanceSettingsIpConfigurationArgs(
                ipv4_enabled=False, private_network=vpc.id, ssl_mode="ENCRYPTED_ONLY"
            ),
        ),
        opts=pulumi.ResourceOptions.merge(
            opts,
            pulumi.ResourceOptions(depends_on=[psa], ignore_changes=["settings.diskSize"]),
        ),
    )
    gcp.sql.Database(f"{name}-db-umbra", name=DB_NAME, instance=db.name, project=project, opts=opts)
    gcp.sql.User(
        f"{name}-db-user",
        name=DB_USER,
        instance=db.name,
        project=project,
        password=password,
        opts=opts,
    )
    place = Placement(cloud="gcp", project=project, zone=args.gcp.zone)
    ca = db.server_ca_certs.apply(lambda certs: (certs[0].cert or "") if certs else "")
    return subnet.id, vpc.id, sa.email, db.private_ip_address, place, ca


def _azure_base(
    name: str, args: ConsoleServiceArgs, password: pulumi.Output[str], opts: pulumi.ResourceOptions
) -> tuple[pulumi.Output[str], None, pulumi.Output[str], Placement]:
    import pulumi_azure_native as azure

    assert args.azure is not None
    location = args.azure.location
    vm_cidr, db_cidr = _halves(args.cidr)
    rg = azure.resources.ResourceGroup(
        f"{name}-rg", resource_group_name=f"umbra-{args.name}", location=location, opts=opts
    )
    nsg = azure.network.NetworkSecurityGroup(
        f"{name}-nsg",
        resource_group_name=rg.name,
        location=location,
        security_rules=[
            azure.network.SecurityRuleArgs(
                name="https-in",
                priority=100,
                direction="Inbound",
                access="Allow",
                protocol="Tcp",
                source_address_prefixes=list(args.ingress_cidrs),
                source_port_range="*",
                destination_address_prefix=vm_cidr,
                destination_port_range=str(CONSOLE_PORT),
            ),
            *(
                # The rule below denies everything else, Azure's default allow for its load
                # balancer's probes included: admit them to the Console's port only.
                [
                    azure.network.SecurityRuleArgs(
                        name="lb-probe-in",
                        priority=105,
                        direction="Inbound",
                        access="Allow",
                        protocol="Tcp",
                        source_address_prefix="AzureLoadBalancer",
                        source_port_range="*",
                        destination_address_prefix=vm_cidr,
                        destination_port_range=str(CONSOLE_PORT),
                    )
                ]
                if args.replicas > 1
                else []
            ),
            azure.network.SecurityRuleArgs(
                name="deny-all-inbound",
                priority=4096,
                direction="Inbound",
                access="Deny",
                protocol="*",
                source_address_prefix="*",
                source_port_range="*",
                destination_address_prefix="*",
                destination_port_range="*",
            ),
        ],
        opts=opts,
    )
    vnet = azure.network.VirtualNetwork(
        f"{name}-vnet",
        resource_group_name=rg.name,
        location=location,
        address_space=azure.network.AddressSpaceArgs(address_prefixes=[args.cidr]),
        opts=pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(ignore_changes=["subnets"])),
    )
    vm_subnet = azure.network.Subnet(
        f"{name}-vm",
        subnet_name="console",
        resource_group_name=rg.name,
        virtual_network_name=vnet.name,
        address_prefix=vm_cidr,
        network_security_group=azure.network.NetworkSecurityGroupArgs(id=nsg.id),
        opts=opts,
    )
    db_subnet = azure.network.Subnet(
        f"{name}-db",
        subnet_name="postgres",
        resource_group_name=rg.name,
        virtual_network_name=vnet.name,
        address_prefix=db_cidr,
        delegations=[
            azure.network.DelegationArgs(
                name="postgres", service_name="Microsoft.DBforPostgreSQL/flexibleServers"
            )
        ],
        opts=pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=[vm_subnet])),
    )
    zone = azure.privatedns.PrivateZone(
        f"{name}-dns",
        private_zone_name=f"umbra-{args.name}.private.postgres.database.azure.com",
        resource_group_name=rg.name,
        location="global",
        opts=opts,
    )
    link = azure.privatedns.VirtualNetworkLink(
        f"{name}-dns-link",
        private_zone_name=zone.name,
        resource_group_name=rg.name,
        location="global",
        registration_enabled=False,
        virtual_network=azure.privatedns.SubResourceArgs(id=vnet.id),
        opts=opts,
    )
    server = azure.dbforpostgresql.Server(
        f"{name}-pg",
        server_name=f"umbra-{args.name}",
        resource_group_name=rg.name,
        location=location,
        version="16",
        sku=azure.dbforpostgresql.SkuArgs(name=args.db_tier, tier="GeneralPurpose"),
        storage=azure.dbforpostgresql.StorageArgs(storage_size_gb=args.db_storage_gb),
        administrator_login=DB_USER,
        administrator_login_password=password,
        network=azure.dbforpostgresql.NetworkArgs(
            delegated_subnet_resource_id=db_subnet.id,
            private_dns_zone_arm_resource_id=zone.id,
            public_network_access="Disabled",
        ),
        opts=pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=[link])),
    )
    azure.dbforpostgresql.Database(
        f"{name}-pg-umbra",
        database_name=DB_NAME,
        server_name=server.name,
        resource_group_name=rg.name,
        opts=opts,
    )
    place = Placement(
        cloud="azure", location=location, zone=args.azure.zone, resource_group_name=rg.name
    )
    host = server.fully_qualified_domain_name.apply(lambda h: h or "")
    return vm_subnet.id, None, host, place


def _azure_identity_roles(
    name: str,
    args: ConsoleServiceArgs,
    parts: VmParts,
    vault_id: pulumi.Input[str],
    key_id: pulumi.Input[str] | None,
    opts: pulumi.ResourceOptions,
) -> None:
    """One Console VM identity's roles: the provisioner's, the launch secrets' reader and,
    with dev_state, the Dev CVM stacks' key user (the container is its state scope)."""
    import pulumi_azure_native as azure

    _azure_provisioner_roles(name, args, parts, opts)
    assert parts.principal_id is not None
    azure_console_reader(name, parts.principal_id, vault_id, opts)
    if key_id is None:
        return
    sub = azure.authorization.get_client_config_output().subscription_id
    azure.authorization.RoleAssignment(
        f"{name}-kv-dev-state-user",
        principal_id=parts.principal_id,
        principal_type="ServicePrincipal",
        role_definition_id=pulumi.Output.concat(
            "/subscriptions/",
            sub,
            "/providers/Microsoft.Authorization/roleDefinitions/",
            AZURE_KEY_VAULT_CRYPTO_USER,
        ),
        scope=key_id,
        opts=opts,
    )


def _azure_provisioner_roles(
    name: str, args: ConsoleServiceArgs, parts: VmParts, opts: pulumi.ResourceOptions
) -> None:
    """Exactly the provisioner's roles for the Console VM's identity: Virtual Machine
    Contributor on each team resource group, Blob Data Contributor on the state."""
    import pulumi_azure_native as azure

    assert parts.principal_id is not None
    sub = azure.authorization.get_client_config_output().subscription_id

    def role(role_id: str) -> pulumi.Output[str]:
        return pulumi.Output.concat(
            "/subscriptions/", sub, "/providers/Microsoft.Authorization/roleDefinitions/", role_id
        )

    for rg in args.team_resource_groups or [f"umbra-{args.name}"]:
        azure.authorization.RoleAssignment(
            f"{name}-{rg}-vm-contributor",
            principal_id=parts.principal_id,
            principal_type="ServicePrincipal",
            role_definition_id=role(AZURE_VM_CONTRIBUTOR),
            scope=pulumi.Output.concat("/subscriptions/", sub, "/resourceGroups/", rg),
            opts=opts,
        )
    if args.state_scope:
        azure.authorization.RoleAssignment(
            f"{name}-state",
            principal_id=parts.principal_id,
            principal_type="ServicePrincipal",
            role_definition_id=role(AZURE_BLOB_DATA_CONTRIBUTOR),
            scope=args.state_scope,
            opts=opts,
        )
