"""The Azure Standard load balancer in front of a pool of replica VMs (the Console's public one,
console_pool.py; the Security CVMs' internal one, security_pool.py): one frontend, one backend
pool `replicas` that each replica's NIC joins, one probe and one TCP rule on one port, and, where
the replicas have no other way out, an outbound rule for their egress."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pulumi

if TYPE_CHECKING:
    import pulumi_azure_native as azure

POOL = "replicas"


def build_azure_replica_lb(
    name: str,
    *,
    lb_name: str,
    resource_group: pulumi.Input[str],
    location: str,
    frontend: azure.network.FrontendIPConfigurationArgs,
    port: int,
    rule: str,
    probe: str,
    probe_path: str | None = None,
    egress: bool = False,
    tags: Mapping[str, str],
    opts: pulumi.ResourceOptions,
) -> pulumi.Output[str]:
    """Returns the backend pool's id. The probe is an HTTPS GET of `probe_path` where one is
    given, else a TCP connect. `egress`: the rule does no outbound SNAT and an outbound rule on
    the frontend carries the replicas' egress instead (explicit, not Azure's default)."""
    import pulumi_azure_native as azure

    front = frontend.name
    if not isinstance(front, str):
        raise ValueError(f"{lb_name}: the frontend configuration needs a plain name, not {front!r}")
    part = _lb_part(resource_group, lb_name)
    lb = azure.network.LoadBalancer(
        name,
        load_balancer_name=lb_name,
        resource_group_name=resource_group,
        location=location,
        sku=azure.network.LoadBalancerSkuArgs(name="Standard"),
        frontend_ip_configurations=[frontend],
        backend_address_pools=[azure.network.BackendAddressPoolArgs(name=POOL)],
        probes=[
            azure.network.ProbeArgs(
                name=probe,
                protocol="Https" if probe_path else "Tcp",
                port=port,
                request_path=probe_path,
                interval_in_seconds=5,
                number_of_probes=2,
            )
        ],
        load_balancing_rules=[
            azure.network.LoadBalancingRuleArgs(
                name=rule,
                protocol="Tcp",
                frontend_port=port,
                backend_port=port,
                frontend_ip_configuration=part("frontendIPConfigurations", front),
                backend_address_pool=part("backendAddressPools", POOL),
                probe=part("probes", probe),
                # One client on one replica (as GCP's CLIENT_IP affinity).
                load_distribution="SourceIP",
                enable_floating_ip=False,
                enable_tcp_reset=True,
                disable_outbound_snat=True if egress else None,
                idle_timeout_in_minutes=30,
            )
        ],
        outbound_rules=[
            azure.network.OutboundRuleArgs(
                name="egress",
                protocol="All",
                frontend_ip_configurations=[part("frontendIPConfigurations", front)],
                backend_address_pool=part("backendAddressPools", POOL),
                enable_tcp_reset=True,
            )
        ]
        if egress
        else None,
        tags=dict(tags),
        opts=opts,
    )
    return lb.id.apply(lambda i: f"{i}/backendAddressPools/{POOL}")


def _lb_part(resource_group: pulumi.Input[str], lb_name: str) -> Callable[[str, str], Any]:
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
