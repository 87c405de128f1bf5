"""Azure half of TeamNetwork: a resource group and VNet per team, two subnets without default
outbound access, and one NSG per subnet.

Azure's default NSG rules allow all traffic inside the VNet and outbound to the internet at
priorities 65000-65001; each NSG here ends with deny-all rules at 4096 (the lowest a custom rule
may take) so only the named allows pass.
"""

from __future__ import annotations

import pulumi
import pulumi_azure_native as azure

from umbra.components.network import NetworkParts, TeamNetworkArgs
from umbra.components.ports import (
    DEV_ATTESTED_SSH_PORT,
    PRIVATE_ZONE,
    ROLE_DEV,
    ROLE_LABEL,
    ROLE_SECURITY,
    SECURITY_CVM_HOST,
    SECURITY_EGRESS_PORTS,
    SECURITY_TUNNEL_PORT,
    TEAM_LABEL,
)

DENY_ALL_PRIORITY = 4096


def _allow(
    name: str,
    priority: int,
    direction: str,
    source: list[str],
    destination: list[str],
    ports: list[int],
) -> azure.network.SecurityRuleArgs:
    return azure.network.SecurityRuleArgs(
        name=name,
        priority=priority,
        direction=direction,
        access="Allow",
        protocol="Tcp",
        source_address_prefixes=source,
        source_port_range="*",
        destination_address_prefixes=destination,
        destination_port_ranges=[str(p) for p in ports],
    )


def _deny_all(direction: str) -> azure.network.SecurityRuleArgs:
    return azure.network.SecurityRuleArgs(
        name=f"deny-all-{direction.lower()}",
        priority=DENY_ALL_PRIORITY,
        direction=direction,
        access="Deny",
        protocol="*",
        source_address_prefix="*",
        source_port_range="*",
        destination_address_prefix="*",
        destination_port_range="*",
    )


def build_azure_network(
    name: str, args: TeamNetworkArgs, security_ip: str, opts: pulumi.ResourceOptions
) -> NetworkParts:
    assert args.azure is not None
    location = args.azure.location
    prefix = f"umbra-{args.team}"
    tags = {TEAM_LABEL: args.team, **args.labels}

    rg = azure.resources.ResourceGroup(
        f"{name}-rg", resource_group_name=prefix, location=location, tags=tags, opts=opts
    )
    dev_nsg = azure.network.NetworkSecurityGroup(
        f"{name}-dev-nsg",
        network_security_group_name=f"{prefix}-dev",
        resource_group_name=rg.name,
        location=location,
        tags={**tags, ROLE_LABEL: ROLE_DEV},
        security_rules=[
            _allow(
                "attested-ssh-in",
                100,
                "Inbound",
                [str(c) for c in args.ssh_ingress_cidrs],
                [args.dev_cidr],
                [DEV_ATTESTED_SSH_PORT],
            ),
            _deny_all("Inbound"),
            _allow(
                "to-security-cvm",
                100,
                "Outbound",
                [args.dev_cidr],
                [f"{security_ip}/32"],
                [SECURITY_TUNNEL_PORT],
            ),
            _deny_all("Outbound"),
        ],
        opts=opts,
    )
    sec_rules = [
        _allow(
            "tunnel-from-dev",
            100,
            "Inbound",
            [args.dev_cidr],
            [f"{security_ip}/32"],
            [SECURITY_TUNNEL_PORT],
        ),
        _deny_all("Inbound"),
        _allow(
            "web-egress",
            100,
            "Outbound",
            [args.security_cidr],
            ["Internet"],
            list(SECURITY_EGRESS_PORTS),
        ),
        _deny_all("Outbound"),
    ]
    if args.console_cidrs:
        sec_rules.append(
            _allow(
                "console-egress",
                110,
                "Outbound",
                [args.security_cidr],
                list(args.console_cidrs),
                [args.console_port],
            )
        )
    sec_nsg = azure.network.NetworkSecurityGroup(
        f"{name}-security-nsg",
        network_security_group_name=f"{prefix}-security",
        resource_group_name=rg.name,
        location=location,
        tags={**tags, ROLE_LABEL: ROLE_SECURITY},
        security_rules=sec_rules,
        opts=opts,
    )
    # Subnets are separate resources (not inline in the VNet) so later updates do not fight.
    vnet = azure.network.VirtualNetwork(
        f"{name}-vnet",
        virtual_network_name=prefix,
        resource_group_name=rg.name,
        location=location,
        address_space=azure.network.AddressSpaceArgs(
            address_prefixes=[args.dev_cidr, args.security_cidr]
        ),
        tags=tags,
        opts=pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(ignore_changes=["subnets"])),
    )
    dev_subnet = azure.network.Subnet(
        f"{name}-dev",
        subnet_name="dev",
        resource_group_name=rg.name,
        virtual_network_name=vnet.name,
        address_prefix=args.dev_cidr,
        default_outbound_access=False,
        network_security_group=azure.network.NetworkSecurityGroupArgs(id=dev_nsg.id),
        opts=opts,
    )
    sec_subnet = azure.network.Subnet(
        f"{name}-security",
        subnet_name="security",
        resource_group_name=rg.name,
        virtual_network_name=vnet.name,
        address_prefix=args.security_cidr,
        default_outbound_access=False,
        network_security_group=azure.network.NetworkSecurityGroupArgs(id=sec_nsg.id),
        opts=pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=[dev_subnet])),
    )
    zone = azure.privatedns.PrivateZone(
        f"{name}-zone",
        private_zone_name=PRIVATE_ZONE,
        resource_group_name=rg.name,
        location="Global",
        tags=tags,
        opts=opts,
    )
    azure.privatedns.VirtualNetworkLink(
        f"{name}-zone-link",
        virtual_network_link_name=prefix,
        private_zone_name=zone.name,
        resource_group_name=rg.name,
        location="Global",
        registration_enabled=False,
        virtual_network=azure.privatedns.SubResourceArgs(id=vnet.id),
        tags=tags,
        opts=opts,
    )
    azure.privatedns.PrivateRecordSet(
        f"{name}-security-cvm-a",
        private_zone_name=zone.name,
        resource_group_name=rg.name,
        record_type="A",
        relative_record_set_name=SECURITY_CVM_HOST.removesuffix(f".{PRIVATE_ZONE}"),
        a_records=[azure.privatedns.ARecordArgs(ipv4_address=security_ip)],
        ttl=300,
        opts=opts,
    )
    return NetworkParts(
        network_id=vnet.id,
        dev_subnet_id=dev_subnet.id,
        security_subnet_id=sec_subnet.id,
        resource_group_name=rg.name,
    )
