"""Security CVM replicas behind GCP's internal passthrough TCP load balancer: an unmanaged
instance group of the replicas, a TCP health check on the tunnel port, an INTERNAL regional
backend service and a forwarding rule on the team's fixed Security CVM address. Dev CVMs keep
dialling that one address (their firewall rule and host ruleset name it); the passthrough LB
keeps the client's address and delivers to one healthy replica, whose aTLS endpoint the
forwarder attests like any other. CLIENT_IP affinity keeps one Dev CVM on one replica."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pulumi
import pulumi_gcp as gcp

from umbra.components.ports import SECURITY_TUNNEL_PORT


def build_gcp_security_lb(
    name: str,
    *,
    prefix: str,
    project: str,
    region: str,
    zone: str,
    network_id: pulumi.Input[str],
    subnet_id: pulumi.Input[str],
    lb_ip: str,
    instances: Sequence[pulumi.Input[str]],
    opts: pulumi.ResourceOptions,
) -> gcp.compute.ForwardingRule:
    group = gcp.compute.InstanceGroup(
        f"{name}-security-group",
        name=f"{prefix}-sec",
        project=project,
        zone=zone,
        network=network_id,
        instances=list(instances),
        opts=opts,
    )
    check = gcp.compute.HealthCheck(
        f"{name}-security-check",
        name=f"{prefix}-sec-tunnel",
        project=project,
        tcp_health_check=gcp.compute.HealthCheckTcpHealthCheckArgs(port=SECURITY_TUNNEL_PORT),
        opts=opts,
    )
    backend = gcp.compute.RegionBackendService(
        f"{name}-security-backend",
        name=f"{prefix}-sec",
        project=project,
        region=region,
        load_balancing_scheme="INTERNAL",
        protocol="TCP",
        session_affinity="CLIENT_IP",
        health_checks=check.id,
        backends=[
            gcp.compute.RegionBackendServiceBackendArgs(group=group.id, balancing_mode="CONNECTION")
        ],
        opts=opts,
    )
    return gcp.compute.ForwardingRule(
        f"{name}-security-lb",
        name=f"{prefix}-sec",
        project=project,
        region=region,
        load_balancing_scheme="INTERNAL",
        ip_protocol="TCP",
        ip_address=lb_ip,
        ports=[str(SECURITY_TUNNEL_PORT)],
        network=network_id,
        subnetwork=subnet_id,
        backend_service=backend.id,
        opts=opts,
    )


def build_azure_security_lb(
    name: str,
    *,
    prefix: str,
    resource_group: pulumi.Input[str],
    location: str,
    subnet_id: pulumi.Input[str],
    lb_ip: str,
    tags: dict[str, str],
    opts: pulumi.ResourceOptions,
) -> pulumi.Output[str]:
    """An internal Standard load balancer on the fixed address; returns its backend pool's id,
    which each replica's NIC joins. Azure's LB rewrites the destination to the replica's own
    address (no floating IP), so the replicas need no local route; SourceIP distribution keeps
    one Dev CVM on one replica."""
    import pulumi_azure_native as azure

    lb_name = f"{prefix}-sec"
    sub = azure_lb_part(resource_group, lb_name)

    lb = azure.network.LoadBalancer(
        f"{name}-security-lb",
        load_balancer_name=lb_name,
        resource_group_name=resource_group,
        location=location,
        sku=azure.network.LoadBalancerSkuArgs(name="Standard"),
        frontend_ip_configurations=[
            azure.network.FrontendIPConfigurationArgs(
                name="tunnel",
                private_ip_address=lb_ip,
                private_ip_allocation_method="Static",
                subnet=azure.network.SubnetArgs(id=subnet_id),
            )
        ],
        backend_address_pools=[azure.network.BackendAddressPoolArgs(name="replicas")],
        probes=[
            azure.network.ProbeArgs(
                name="tunnel",
                protocol="Tcp",
                port=SECURITY_TUNNEL_PORT,
                interval_in_seconds=5,
                number_of_probes=2,
            )
        ],
        load_balancing_rules=[
            azure.network.LoadBalancingRuleArgs(
                name="tunnel",
                protocol="Tcp",
                frontend_port=SECURITY_TUNNEL_PORT,
                backend_port=SECURITY_TUNNEL_PORT,
                frontend_ip_configuration=sub("frontendIPConfigurations", "tunnel"),
                backend_address_pool=sub("backendAddressPools", "replicas"),
                probe=sub("probes", "tunnel"),
                load_distribution="SourceIP",
                enable_floating_ip=False,
                enable_tcp_reset=True,
                idle_timeout_in_minutes=30,
            )
        ],
        tags=tags,
        opts=opts,
    )
    return lb.id.apply(lambda i: f"{i}/backendAddressPools/replicas")


def azure_lb_part(resource_group: pulumi.Input[str], lb_name: str) -> Callable[[str, str], Any]:
    """`part(kind, name)`: a sub-resource reference inside load balancer `lb_name`. Sub-resources
    of one load balancer name each other by id, which Azure derives from names, so the ids are
    known before the balancer exists."""
    import pulumi_azure_native as azure

    client = azure.authorization.get_client_config_output()
    lb_id = pulumi.Output.concat(
        "/subscriptions/",
        client.subscription_id,
        "/resourceGroups/",
        resource_group,
        "/providers/Microsoft.Network/loadBalancers/",
        lb_name,
    )

    def part(kind: str, name: str) -> Any:
        return azure.network.SubResourceArgs(id=pulumi.Output.concat(lb_id, f"/{kind}/{name}"))

    return part
