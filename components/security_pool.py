"""Security CVM replicas behind GCP's internal passthrough TCP load balancer: an unmanaged
instance group of the replicas, a TCP health check on the tunnel port, an INTERNAL regional
backend service and a forwarding rule on the team's fixed Security CVM address. Dev CVMs keep
dialling that one address (their firewall rule and host ruleset name it); the passthrough LB
keeps the client's address and delivers to one healthy replica, whose aTLS endpoint the
forwarder attests like any other. CLIENT_IP affinity keeps one Dev CVM on one replica."""

from __future__ import annotations

from collections.abc import Sequence

import pulumi
import pulumi_gcp as gcp

from umbra.components.azure_lb import build_azure_replica_lb
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

    return build_azure_replica_lb(
        f"{name}-security-lb",
        lb_name=f"{prefix}-sec",
        resource_group=resource_group,
        location=location,
        frontend=azure.network.FrontendIPConfigurationArgs(
            name="tunnel",
            private_ip_address=lb_ip,
            private_ip_allocation_method="Static",
            subnet=azure.network.SubnetArgs(id=subnet_id),
        ),
        port=SECURITY_TUNNEL_PORT,
        rule="tunnel",
        probe="tunnel",
        tags=tags,
        opts=opts,
    )
