"""Azure half of TeamNetwork: a resource group and VNet per team, two subnets without default
outbound access, and one NSG per subnet.

Azure's default NSG rules allow all traffic inside the VNet and outbound to the internet at
priorities 65000-65001; each NSG here ends with deny-all rules at 4096 (the lowest a custom rule
may take) so only the named allows pass.

With `dev_console_ips`, the dev subnet also gets the team's NAT Gateway and a route table that
drops every internet destination but those /32s, and its NSG allows exactly them on tcp 443
(the forwarder's enrollment at the Console): two layers, as for everything else.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import pulumi
import pulumi_azure_native as azure

from umbra.components.network import NetworkParts, TeamNetworkArgs, console_hosts
from umbra.components.ports import (
    CONSOLE_PORT,
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
# The platform resolver (168.63.129.16) is reachable whatever `*` rules say; its service tag
# is the one way an NSG names it, so the Dev NSG denies it explicitly above everything else.
PLATFORM_DNS_TAG = "AzurePlatformDNS"
PLATFORM_DNS_PRIORITY = 100
# Dev CVM -> Console on 443: after the tunnel allow (110), long before the deny-all (4096).
DEV_CONSOLE_PRIORITY = 120


def _prefixes(side: str, values: list[str]) -> dict[str, Any]:
    """Azure takes service tags ("Internet", "AzurePlatformDNS") only in the single-value field;
    the list field refuses them (SecurityRuleParameterContainsUnsupportedValue)."""
    if len(values) == 1:
        return {f"{side}_address_prefix": values[0]}
    tags = [v for v in values if not _is_cidr(v)]
    if tags:
        raise ValueError(f"{side} prefixes {values}: service tags {tags} cannot share a rule")
    return {f"{side}_address_prefixes": values}


def _is_cidr(value: str) -> bool:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        return False
    return True


def _allow(
    name: str,
    priority: int,
    direction: str,
    source: list[str],
    destination: list[str],
    ports: list[int],
    protocol: str = "Tcp",
) -> azure.network.SecurityRuleArgs:
    return azure.network.SecurityRuleArgs(
        name=name,
        priority=priority,
        direction=direction,
        access="Allow",
        protocol=protocol,
        source_port_range="*",
        destination_port_ranges=[str(p) for p in ports],
        **_prefixes("source", source),
        **_prefixes("destination", destination),
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
    consoles = console_hosts(args)
    dev_console_rules = (
        [
            _allow(
                "to-console",
                DEV_CONSOLE_PRIORITY,
                "Outbound",
                [args.dev_cidr],
                consoles,
                [CONSOLE_PORT],
            )
        ]
        if consoles
        else []
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
                [str(c) for c in args.ssh_ingress_cidrs]
                + ([args.bastion_cidr] if args.bastion_cidr else []),
                [args.dev_cidr],
                [DEV_ATTESTED_SSH_PORT],
            ),
            _deny_all("Inbound"),
            azure.network.SecurityRuleArgs(
                name="deny-platform-dns",
                priority=PLATFORM_DNS_PRIORITY,
                direction="Outbound",
                access="Deny",
                protocol="*",
                source_address_prefix="*",
                source_port_range="*",
                destination_address_prefix=PLATFORM_DNS_TAG,
                destination_port_range="*",
            ),
            _allow(
                "to-security-cvm",
                110,
                "Outbound",
                [args.dev_cidr],
                [f"{security_ip}/32"],
                [SECURITY_TUNNEL_PORT],
            ),
            *dev_console_rules,
            _deny_all("Outbound"),
        ],
        opts=opts,
    )
    # Replicas sit behind an internal load balancer that rewrites the destination to the
    # replica's own address, and its health probe comes from the AzureLoadBalancer tag.
    tunnel_dst = [args.security_cidr] if args.security_replicas > 1 else [f"{security_ip}/32"]
    sec_rules = [
        _allow(
            "tunnel-from-dev",
            100,
            "Inbound",
            [args.dev_cidr],
            tunnel_dst,
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
    if args.security_replicas > 1:
        sec_rules.append(
            _allow(
                "lb-probe-in",
                105,
                "Inbound",
                ["AzureLoadBalancer"],
                [args.security_cidr],
                [SECURITY_TUNNEL_PORT],
            )
        )
    for i, proto in enumerate(("Udp", "Tcp")):
        sec_rules.append(
            _allow(
                f"dns-egress-{proto.lower()}",
                120 + i,
                "Outbound",
                [args.security_cidr],
                [f"{ip}/32" for ip in args.security_dns_resolvers],
                [53],
                protocol=proto,
            )
        )
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
            + ([args.bastion_cidr] if args.bastion_cidr else [])
        ),
        tags=tags,
        opts=pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(ignore_changes=["subnets"])),
    )
    # Security CVM egress: a NAT Gateway on one static Standard address, no public IP on the VM.
    egress_ip = azure.network.PublicIPAddress(
        f"{name}-egress-ip",
        public_ip_address_name=f"{prefix}-egress",
        resource_group_name=rg.name,
        location=location,
        sku=azure.network.PublicIPAddressSkuArgs(name="Standard"),
        public_ip_allocation_method="Static",
        zones=[args.azure.zone] if args.azure.zone else None,
        tags={**tags, ROLE_LABEL: ROLE_SECURITY},
        opts=opts,
    )
    nat = azure.network.NatGateway(
        f"{name}-nat",
        nat_gateway_name=f"{prefix}-nat",
        resource_group_name=rg.name,
        location=location,
        sku=azure.network.NatGatewaySkuArgs(name="Standard"),
        public_ip_addresses=[azure.network.SubResourceArgs(id=egress_ip.id)],
        zones=[args.azure.zone] if args.azure.zone else None,
        tags={**tags, ROLE_LABEL: ROLE_SECURITY},
        opts=opts,
    )
    dev_subnet = azure.network.Subnet(
        f"{name}-dev",
        subnet_name="dev",
        resource_group_name=rg.name,
        virtual_network_name=vnet.name,
        address_prefix=args.dev_cidr,
        default_outbound_access=False,
        network_security_group=azure.network.NetworkSecurityGroupArgs(id=dev_nsg.id),
        **_dev_console_path(name, prefix, rg.name, location, consoles, nat, tags, opts),
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
        nat_gateway=azure.network.SubResourceArgs(id=nat.id),
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
    _close_dns(name, prefix, rg.name, location, vnet.id, tags, opts)
    if args.reachability == "bastion" and args.bastion_cidr:
        _bastion(name, prefix, args, rg.name, vnet, tags, opts, after=sec_subnet)
    return NetworkParts(
        network_id=vnet.id,
        dev_subnet_id=dev_subnet.id,
        security_subnet_id=sec_subnet.id,
        resource_group_name=rg.name,
        egress_ip=egress_ip.ip_address.apply(lambda a: a or ""),
    )


def _dev_console_path(
    name: str,
    prefix: str,
    rg: pulumi.Output[str],
    location: str,
    consoles: list[str],
    nat: azure.network.NatGateway,
    tags: dict[str, str],
    opts: pulumi.ResourceOptions,
) -> dict[str, Any]:
    """The dev subnet's way to the Console, or nothing: the NAT Gateway (the subnet has no
    default outbound access) and a route table whose internet routes are the Console's /32s
    only, every other public destination dropped (`None`) even if an NSG rule went wrong.
    Addresses inside the VNet keep their more specific system routes."""
    if not consoles:
        return {}
    table = azure.network.RouteTable(
        f"{name}-dev-routes",
        route_table_name=f"{prefix}-dev",
        resource_group_name=rg,
        location=location,
        routes=[
            azure.network.RouteArgs(
                name=f"console-{i}", address_prefix=host, next_hop_type="Internet"
            )
            for i, host in enumerate(consoles)
        ]
        + [
            azure.network.RouteArgs(
                name="drop-internet", address_prefix="0.0.0.0/0", next_hop_type="None"
            )
        ],
        tags={**tags, ROLE_LABEL: ROLE_DEV},
        opts=opts,
    )
    return {
        "nat_gateway": azure.network.SubResourceArgs(id=nat.id),
        "route_table": azure.network.RouteTableArgs(id=table.id),
    }


def _close_dns(
    name: str,
    prefix: str,
    rg: pulumi.Output[str],
    location: str,
    vnet_id: pulumi.Output[str],
    tags: dict[str, str],
    opts: pulumi.ResourceOptions,
) -> None:
    """A DNS security policy on the VNet: the platform resolver answers the private zone and
    blocks every other name, so no query leaves for a foreign authoritative server."""
    policy = azure.dnsresolver.DnsResolverPolicy(
        f"{name}-dns-policy",
        dns_resolver_policy_name=f"{prefix}-closed",
        resource_group_name=rg,
        location=location,
        tags=tags,
        opts=opts,
    )
    lists = {
        "private": [f"{PRIVATE_ZONE}."],
        "everything": ["."],
    }
    domain_lists = {
        key: azure.dnsresolver.DnsResolverDomainList(
            f"{name}-dns-{key}",
            dns_resolver_domain_list_name=f"{prefix}-{key}",
            resource_group_name=rg,
            location=location,
            domains=domains,
            tags=tags,
            opts=opts,
        )
        for key, domains in lists.items()
    }
    for rule, priority, action, key in (
        ("allow-private-zone", 100, "Allow", "private"),
        ("block-everything-else", 1000, "Block", "everything"),
    ):
        azure.dnsresolver.DnsSecurityRule(
            f"{name}-dns-{rule}",
            dns_security_rule_name=rule,
            dns_resolver_policy_name=policy.name,
            resource_group_name=rg,
            location=location,
            priority=priority,
            action=azure.dnsresolver.DnsSecurityRuleActionArgs(action_type=action),
            dns_resolver_domain_lists=[azure.dnsresolver.SubResourceArgs(id=domain_lists[key].id)],
            dns_security_rule_state="Enabled",
            tags=tags,
            opts=opts,
        )
    azure.dnsresolver.DnsResolverPolicyVirtualNetworkLink(
        f"{name}-dns-policy-link",
        dns_resolver_policy_virtual_network_link_name=prefix,
        dns_resolver_policy_name=policy.name,
        resource_group_name=rg,
        location=location,
        virtual_network=azure.dnsresolver.SubResourceArgs(id=vnet_id),
        tags=tags,
        opts=opts,
    )


def _bastion(
    name: str,
    prefix: str,
    args: TeamNetworkArgs,
    rg: pulumi.Output[str],
    vnet: azure.network.VirtualNetwork,
    tags: dict[str, str],
    opts: pulumi.ResourceOptions,
    after: pulumi.Resource,
) -> None:
    """Azure Bastion (Standard, native-client tunnelling): `az network bastion tunnel` carries
    the developer's aTLS connection to the Dev CVM's port 8022; the Dev NSG admits it from the
    Bastion subnet only."""
    assert args.azure is not None and args.bastion_cidr is not None
    subnet = azure.network.Subnet(
        f"{name}-bastion",
        subnet_name="AzureBastionSubnet",  # the name Azure requires
        resource_group_name=rg,
        virtual_network_name=vnet.name,
        address_prefix=args.bastion_cidr,
        opts=pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=[after])),
    )
    pip = azure.network.PublicIPAddress(
        f"{name}-bastion-ip",
        public_ip_address_name=f"{prefix}-bastion",
        resource_group_name=rg,
        location=args.azure.location,
        sku=azure.network.PublicIPAddressSkuArgs(name="Standard"),
        public_ip_allocation_method="Static",
        tags={**tags, ROLE_LABEL: "bastion"},
        opts=opts,
    )
    azure.network.BastionHost(
        f"{name}-bastion-host",
        bastion_host_name=f"{prefix}-bastion",
        resource_group_name=rg,
        location=args.azure.location,
        sku=azure.network.SkuArgs(name="Standard"),
        enable_tunneling=True,
        enable_file_copy=False,
        enable_shareable_link=False,
        ip_configurations=[
            azure.network.BastionHostIPConfigurationArgs(
                name="primary",
                subnet=azure.network.SubResourceArgs(id=subnet.id),
                public_ip_address=azure.network.SubResourceArgs(id=pip.id),
            )
        ],
        tags={**tags, ROLE_LABEL: "bastion"},
        opts=opts,
    )
