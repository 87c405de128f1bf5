"""TeamNetwork: one team's private network. Dev CVMs reach only their team's Security CVM (on the
tunnel port), plus the Console's declared addresses on tcp 443 for their forwarder's one
enrollment, and accept only the attested SSH port from named ranges; the Security CVM accepts
the tunnel from Dev CVMs and egresses only on 80/443 (and to the Console). No peering, no shared
resources: each team's network stands alone.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import pulumi

from umbra.components.config import AzurePlacement, GcpPlacement, console_address_problem

Cloud = Literal["gcp", "azure"]


def security_replica_ip(security_cidr: str, replica: int, replicas: int) -> str:
    """One replica: the fixed address itself. Several: .11, .12, … behind the load balancer,
    whose frontend holds the fixed address."""
    if replicas == 1:
        return security_cvm_ip(security_cidr)
    return str(ipaddress.IPv4Network(security_cidr).network_address + 11 + replica)


def security_cvm_ip(security_cidr: str) -> str:
    """The Security CVM's fixed private address: Dev CVM egress rules name exactly this /32.
    Host 10 clears every cloud's reserved low addresses (GCP .0-.1, Azure .0-.3)."""
    return str(ipaddress.IPv4Network(security_cidr).network_address + 10)


@dataclass(frozen=True)
class TeamNetworkArgs:
    team: str
    cloud: Cloud
    dev_cidr: str
    security_cidr: str
    ssh_ingress_cidrs: Sequence[str]
    console_cidrs: Sequence[str] = ()
    # The Console's port when `console_cidrs` is used (443 to the internet is always allowed).
    console_port: int = 443
    # The Console's addresses (the team stack's `console_ips`): Dev CVMs may open tcp 443 to
    # exactly these /32s, routed and NATed out (their forwarder enrolls there once; the host
    # firewall admits only the forwarder's uplink). Empty: no Dev CVM path out but the tunnel.
    dev_console_ips: Sequence[str] = ()
    gcp: GcpPlacement | None = None
    azure: AzurePlacement | None = None
    labels: dict[str, str] = field(default_factory=dict)
    # Public resolvers the Security CVM's proxy uses (the team network's own DNS is closed).
    security_dns_resolvers: Sequence[str] = ("8.8.8.8", "1.1.1.1")
    # Log denied flows (firewall deny rules, NAT errors): off by default, it costs per packet.
    log_denied: bool = False
    # public | iap (GCP) | bastion (Azure): see components.config.NetworkConfig.
    reachability: str = "private"
    iap_members: Sequence[str] = ()
    bastion_cidr: str | None = None
    # Security CVM replicas (> 1: GCP health-check ingress for the internal load balancer).
    security_replicas: int = 1

    def __post_init__(self) -> None:
        # The config layer checks this too; components are also used directly (automation).
        for cidr in self.ssh_ingress_cidrs:
            if ipaddress.IPv4Network(cidr).prefixlen == 0:
                raise ValueError(f"ssh_ingress_cidrs: {cidr} would open SSH to the internet")
        for ip in self.dev_console_ips:
            # A bare address only: "203.0.113.0/24" or a name is refused here, not widened.
            try:
                addr = ipaddress.IPv4Address(ip)
            except ValueError:
                raise ValueError(f"dev_console_ips: {ip!r} is not one IPv4 address") from None
            problem = console_address_problem(addr)
            if problem:
                raise ValueError(f"dev_console_ips: {problem}")
            for net in (self.dev_cidr, self.security_cidr):
                if addr in ipaddress.IPv4Network(net):
                    raise ValueError(f"dev_console_ips: {ip} is inside the team range {net}")
        if (self.cloud == "gcp") != (self.gcp is not None):
            raise ValueError("TeamNetworkArgs: gcp placement must be given exactly for cloud 'gcp'")
        if (self.cloud == "azure") != (self.azure is not None):
            raise ValueError(
                "TeamNetworkArgs: azure placement must be given exactly for cloud 'azure'"
            )


@dataclass
class NetworkParts:
    """What a cloud builder hands back; the component registers these as its outputs."""

    network_id: pulumi.Output[str]
    dev_subnet_id: pulumi.Output[str]
    security_subnet_id: pulumi.Output[str]
    # GCP: service account emails used as firewall targets. Azure: None (NSGs are per subnet).
    dev_identity: pulumi.Output[str] | None = None
    security_identity: pulumi.Output[str] | None = None
    # Azure: the team's resource group. GCP: None.
    resource_group_name: pulumi.Output[str] | None = None
    # The Security CVM's static egress address (Cloud NAT / NAT Gateway).
    egress_ip: pulumi.Output[str] | None = None


class TeamNetwork(pulumi.ComponentResource):
    network_id: pulumi.Output[str]
    dev_subnet_id: pulumi.Output[str]
    security_subnet_id: pulumi.Output[str]
    security_cvm_ip: pulumi.Output[str]
    dev_identity: pulumi.Output[str] | None
    security_identity: pulumi.Output[str] | None
    resource_group_name: pulumi.Output[str] | None
    egress_ip: pulumi.Output[str] | None

    def __init__(
        self, name: str, args: TeamNetworkArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("umbra:infra:TeamNetwork", name, None, opts)
        self.args = args
        ip = security_cvm_ip(args.security_cidr)
        child = pulumi.ResourceOptions(parent=self)
        if args.cloud == "gcp":
            from umbra.components.gcp_network import build_gcp_network

            parts = build_gcp_network(name, args, ip, child)
        else:
            from umbra.components.azure_network import build_azure_network

            parts = build_azure_network(name, args, ip, child)
        self.network_id = parts.network_id
        self.dev_subnet_id = parts.dev_subnet_id
        self.security_subnet_id = parts.security_subnet_id
        self.security_cvm_ip = pulumi.Output.from_input(ip)
        self.dev_identity = parts.dev_identity
        self.security_identity = parts.security_identity
        self.resource_group_name = parts.resource_group_name
        self.egress_ip = parts.egress_ip
        outputs: dict[str, pulumi.Input[str]] = {
            "network_id": self.network_id,
            "dev_subnet_id": self.dev_subnet_id,
            "security_subnet_id": self.security_subnet_id,
            "security_cvm_ip": self.security_cvm_ip,
        }
        for key, value in (
            ("dev_identity", self.dev_identity),
            ("security_identity", self.security_identity),
            ("resource_group_name", self.resource_group_name),
            ("egress_ip", self.egress_ip),
        ):
            if value is not None:
                outputs[key] = value
        self.register_outputs(outputs)


def console_hosts(args: TeamNetworkArgs) -> list[str]:
    """The Dev CVMs' Console destinations as /32s, in a stable order."""
    return [f"{ipaddress.IPv4Address(ip)}/32" for ip in sorted(set(args.dev_console_ips))]
