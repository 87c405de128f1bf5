"""Console replicas behind the cloud's passthrough TCP load balancer (docs/specs/infra.md
"Console replicas"). The LB forwards TCP 443 unchanged, so TLS (the Console's certificate, whose
chain is measured in its launch data) still terminates on each Console CVM: the cloud never holds
the key and a client's TLS session ends inside the attested VM.

GCP: a TDX instance template carrying the launch data, a regional managed instance group of N
replicas, regional HTTPS health checks (`/readyz` routes the LB, `/healthz` drives autohealing),
an EXTERNAL regional backend service and a forwarding rule on the Console's static address, and
a Cloud NAT for the replicas' egress (they have no external address). Azure: a public Standard
load balancer on the Console's static address whose backend pool each replica VM's NIC joins,
an HTTPS probe on `/readyz`, and an outbound rule for egress."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pulumi

from umbra.components.azure_lb import build_azure_replica_lb
from umbra.components.launch_data import LaunchData

CONSOLE_PORT = 443
# The load balancers route to replicas that are ready (the database answers, migrated to this
# build's head: console.md); autohealing recreates only a replica that does not answer at all,
# so a database outage never has the group recreate every Console.
READY_PATH = "/readyz"
LIVE_PATH = "/healthz"
# Where GCP's health checks come from: a backend-service-based external passthrough LB's
# (35.191.0.0/16, 209.85.152.0/22, 209.85.204.0/22) and the group's autohealing probes
# (35.191.0.0/16, 130.211.0.0/22).
GCP_NLB_HEALTH_RANGES = ("35.191.0.0/16", "130.211.0.0/22", "209.85.152.0/22", "209.85.204.0/22")
# A new replica boots the OS image, its launch agent and the Console before it answers.
AUTOHEAL_DELAY_SECONDS = 600


def gcp_static_address(
    name: str,
    vm_name: str,
    project: str | None,
    region: str,
    labels: Mapping[str, str],
    opts: pulumi.ResourceOptions,
) -> pulumi.Output[str]:
    """The Console's reserved external address: the same resource whether one VM holds it or
    the load balancer's forwarding rule does, so scaling out keeps the address team stacks pin."""
    import pulumi_gcp as gcp

    return gcp.compute.Address(
        f"{name}-ip",
        name=f"{vm_name}-ip",
        project=project,
        region=region,
        address_type="EXTERNAL",
        network_tier="PREMIUM",
        labels=dict(labels),
        opts=opts,
    ).address


def build_gcp_console_pool(
    name: str,
    *,
    prefix: str,
    project: str,
    region: str,
    zone: str,
    network_id: pulumi.Input[str],
    subnet_id: pulumi.Input[str],
    identity: pulumi.Input[str],
    size: str,
    image: str,
    disk_gb: int,
    labels: Mapping[str, str],
    launch: pulumi.Output[LaunchData],
    address: pulumi.Input[str],
    replicas: int,
    opts: pulumi.ResourceOptions,
) -> None:
    import pulumi_gcp as gcp

    from umbra.components.gcp_vm import API_SCOPES

    # Only the health checkers, only on the Console's port, only to the Console's identity.
    gcp.compute.Firewall(
        f"{name}-lb-health-in",
        name=f"{prefix}-lb-health-in",
        project=project,
        network=network_id,
        direction="INGRESS",
        target_service_accounts=[identity],
        source_ranges=list(GCP_NLB_HEALTH_RANGES),
        allows=[gcp.compute.FirewallAllowArgs(protocol="tcp", ports=[str(CONSOLE_PORT)])],
        opts=opts,
    )
    router = gcp.compute.Router(
        f"{name}-router",
        name=f"{prefix}-router",
        project=project,
        region=region,
        network=network_id,
        opts=opts,
    )
    gcp.compute.RouterNat(
        f"{name}-nat",
        name=f"{prefix}-nat",
        project=project,
        region=region,
        router=router.name,
        nat_ip_allocate_option="AUTO_ONLY",
        source_subnetwork_ip_ranges_to_nat="ALL_SUBNETWORKS_ALL_IP_RANGES",
        opts=opts,
    )
    # Every replica boots the same measured launch data. A template is immutable: a launch-data
    # change is a new template (name_prefix, created before the old one goes), and the group
    # replaces its instances one by one (surge 1, none unavailable).
    template = gcp.compute.InstanceTemplate(
        f"{name}-template",
        name_prefix=f"{prefix}-",
        project=project,
        machine_type=size,
        confidential_instance_config=gcp.compute.InstanceTemplateConfidentialInstanceConfigArgs(
            confidential_instance_type="TDX"
        ),
        scheduling=gcp.compute.InstanceTemplateSchedulingArgs(
            on_host_maintenance="TERMINATE", automatic_restart=True, provisioning_model="STANDARD"
        ),
        shielded_instance_config=gcp.compute.InstanceTemplateShieldedInstanceConfigArgs(
            enable_secure_boot=True, enable_vtpm=True, enable_integrity_monitoring=True
        ),
        disks=[
            gcp.compute.InstanceTemplateDiskArgs(
                boot=True,
                auto_delete=True,
                source_image=image,
                disk_size_gb=disk_gb,
                disk_type="pd-balanced",
                labels=dict(labels),
            )
        ],
        # No access config: the LB's address is the only public one; egress via Cloud NAT.
        network_interfaces=[gcp.compute.InstanceTemplateNetworkInterfaceArgs(subnetwork=subnet_id)],
        can_ip_forward=False,
        service_account=gcp.compute.InstanceTemplateServiceAccountArgs(
            email=identity, scopes=API_SCOPES
        ),
        # Each replica takes the balancer's address as a local route (launch agent: LocalRoutes).
        metadata=pulumi.Output.all(launch, address).apply(
            lambda v: replace(v[0], lb_ip=v[1]).gcp_metadata()
        ),
        labels=dict(labels),
        opts=opts,
    )

    def health(suffix: str, path: str, unhealthy: int) -> gcp.compute.RegionHealthCheck:
        return gcp.compute.RegionHealthCheck(
            f"{name}-{suffix}",
            name=f"{prefix}-{suffix}",
            project=project,
            region=region,
            check_interval_sec=5,
            timeout_sec=5,
            healthy_threshold=2,
            unhealthy_threshold=unhealthy,
            https_health_check=gcp.compute.RegionHealthCheckHttpsHealthCheckArgs(
                port=CONSOLE_PORT, request_path=path
            ),
            opts=opts,
        )

    ready = health("ready", READY_PATH, 3)
    live = health("live", LIVE_PATH, 6)
    group = gcp.compute.RegionInstanceGroupManager(
        f"{name}-group",
        name=f"{prefix}-group",
        base_instance_name=prefix,
        project=project,
        region=region,
        # TDX C3 capacity is per zone: the stack's zone, the one its placement names.
        distribution_policy_zones=[zone],
        target_size=replicas,
        versions=[
            gcp.compute.RegionInstanceGroupManagerVersionArgs(
                name="console", instance_template=template.self_link_unique
            )
        ],
        named_ports=[
            gcp.compute.RegionInstanceGroupManagerNamedPortArgs(name="https", port=CONSOLE_PORT)
        ],
        auto_healing_policies=gcp.compute.RegionInstanceGroupManagerAutoHealingPoliciesArgs(
            health_check=live.id, initial_delay_sec=AUTOHEAL_DELAY_SECONDS
        ),
        update_policy=gcp.compute.RegionInstanceGroupManagerUpdatePolicyArgs(
            type="PROACTIVE",
            minimal_action="REPLACE",
            replacement_method="SUBSTITUTE",
            max_surge_fixed=1,
            max_unavailable_fixed=0,
        ),
        opts=opts,
    )
    backend = gcp.compute.RegionBackendService(
        f"{name}-backend",
        name=f"{prefix}-backend",
        project=project,
        region=region,
        load_balancing_scheme="EXTERNAL",
        protocol="TCP",
        # One browser on one replica while it lives: a web session's key is per replica until
        # the launch delivers a shared WEB_SESSION_KEY (infra.md "Console replicas").
        session_affinity="CLIENT_IP",
        health_checks=ready.id,
        backends=[
            gcp.compute.RegionBackendServiceBackendArgs(
                group=group.instance_group, balancing_mode="CONNECTION"
            )
        ],
        opts=opts,
    )
    gcp.compute.ForwardingRule(
        f"{name}-lb",
        name=f"{prefix}-lb",
        project=project,
        region=region,
        load_balancing_scheme="EXTERNAL",
        ip_protocol="TCP",
        ip_address=address,
        ports=[str(CONSOLE_PORT)],
        network_tier="PREMIUM",
        backend_service=backend.id,
        opts=opts,
    )


def build_azure_console_lb(
    name: str,
    *,
    vm_name: str,
    resource_group: pulumi.Input[str],
    location: str,
    zone: str | None,
    tags: Mapping[str, str],
    opts: pulumi.ResourceOptions,
) -> tuple[pulumi.Output[str], pulumi.Output[str]]:
    """A public Standard load balancer on the Console's static address (the same resource name
    the single VM's address has). Returns (its backend pool's id, the address)."""
    import pulumi_azure_native as azure

    zones = [zone] if zone else None
    pip = azure.network.PublicIPAddress(
        f"{name}-pip",
        public_ip_address_name=f"{vm_name}-pip",
        resource_group_name=resource_group,
        location=location,
        sku=azure.network.PublicIPAddressSkuArgs(name="Standard"),
        public_ip_allocation_method="Static",
        zones=zones,
        tags=dict(tags),
        opts=opts,
    )
    pool = build_azure_replica_lb(
        f"{name}-lb",
        lb_name=f"{vm_name}-lb",
        resource_group=resource_group,
        location=location,
        frontend=azure.network.FrontendIPConfigurationArgs(
            name="console", public_ip_address=azure.network.PublicIPAddressArgs(id=pip.id)
        ),
        port=CONSOLE_PORT,
        rule="https",
        probe="readyz",
        probe_path=READY_PATH,
        # The replicas have no public address: their egress goes by an outbound rule.
        egress=True,
        tags=tags,
        opts=opts,
    )
    return pool, pip.ip_address.apply(lambda a: a or "")
