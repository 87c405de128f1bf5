"""GCP half of TeamNetwork: a custom-mode VPC without the default internet route, two subnets,
one service account per role (firewall targets by identity, not by tag), and firewall rules.

GCP firewalls are stateful, so replies to allowed ingress need no egress rule; the deny-all
egress rules sit at the lowest priority so only the named allows above them pass. The default
internet route exists only for instances tagged as the Security CVM, so even a mistaken firewall
rule leaves a Dev CVM with no route out. The one exception: with `dev_console_ips`, a /32 route
per Console address (and Cloud NAT for the dev subnet) carries the forwarder's enrollment, and
the firewall admits exactly those /32s on tcp 443.
"""

from __future__ import annotations

import pulumi
import pulumi_gcp as gcp

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
    SECURITY_ROUTE_TAG,
    SECURITY_TUNNEL_PORT,
    TEAM_LABEL,
)

ALLOW_PRIORITY = 1000
DENY_ALL_PRIORITY = 65000
# Where Google's load-balancer health checks come from.
HEALTH_CHECK_RANGES = ("35.191.0.0/16", "130.211.0.0/22")
# Where IAP TCP forwarding connects from.
IAP_RANGE = "35.235.240.0/20"
# The APIs a team stack calls; enabled by the stack so a fresh project deploys.
REQUIRED_APIS = ("compute.googleapis.com", "dns.googleapis.com", "iam.googleapis.com")
# What every name but the Security CVM's resolves to inside a team VPC: nothing routable.
BLACKHOLE_ADDRESS = "0.0.0.0"  # noqa: S104 -- a DNS answer, not a bind address


def build_gcp_network(
    name: str, args: TeamNetworkArgs, security_ip: str, opts: pulumi.ResourceOptions
) -> NetworkParts:
    assert args.gcp is not None
    project, region = args.gcp.project, args.gcp.region
    prefix = f"umbra-{args.team}"
    labels = {TEAM_LABEL: args.team, **args.labels}
    # A fresh project has these APIs off; everything below waits for them. Destroying one team
    # must not turn them off for the other teams or the Console in the same project.
    services = [
        gcp.projects.Service(
            f"{name}-api-{api.split('.')[0]}",
            project=project,
            service=api,
            disable_on_destroy=False,
            opts=opts,
        )
        for api in REQUIRED_APIS + (("iap.googleapis.com",) if args.reachability == "iap" else ())
    ]
    opts = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=services))

    vpc = gcp.compute.Network(
        f"{name}-vpc",
        name=prefix,
        project=project,
        auto_create_subnetworks=False,
        delete_default_routes_on_create=True,
        routing_mode="REGIONAL",
        opts=opts,
    )
    zone = gcp.dns.ManagedZone(
        f"{name}-zone",
        name=f"{prefix}-internal",
        project=project,
        dns_name=f"{PRIVATE_ZONE}.",
        visibility="private",
        private_visibility_config=gcp.dns.ManagedZonePrivateVisibilityConfigArgs(
            networks=[gcp.dns.ManagedZonePrivateVisibilityConfigNetworkArgs(network_url=vpc.id)]
        ),
        opts=opts,
    )
    gcp.dns.RecordSet(
        f"{name}-security-cvm-a",
        project=project,
        managed_zone=zone.name,
        name=f"{SECURITY_CVM_HOST}.",
        type="A",
        ttl=300,
        rrdatas=[security_ip],
        opts=opts,
    )
    # Cloud-side DNS closure: the metadata server's resolver answers every name in this VPC from
    # the response policy, so no query reaches a foreign authoritative server. Only the Security
    # CVM's name passes through to the private zone. The Security CVM resolves public names
    # through its own resolvers (security_dns_resolvers), over Cloud NAT, not through this VPC.
    policy = gcp.dns.ResponsePolicy(
        f"{name}-dns-policy",
        response_policy_name=f"{prefix}-closed",
        project=project,
        description=f"Umbra team {args.team}: no public name resolution inside the team VPC",
        networks=[gcp.dns.ResponsePolicyNetworkArgs(network_url=vpc.id)],
        opts=opts,
    )
    gcp.dns.ResponsePolicyRule(
        f"{name}-dns-deny-all",
        project=project,
        response_policy=policy.response_policy_name,
        rule_name="deny-all",
        dns_name="*.",
        local_data=gcp.dns.ResponsePolicyRuleLocalDataArgs(
            local_datas=[
                gcp.dns.ResponsePolicyRuleLocalDataLocalDataArgs(
                    name="*.", type="A", ttl=300, rrdatas=[BLACKHOLE_ADDRESS]
                )
            ]
        ),
        opts=opts,
    )
    gcp.dns.ResponsePolicyRule(
        f"{name}-dns-security-cvm",
        project=project,
        response_policy=policy.response_policy_name,
        rule_name="security-cvm",
        dns_name=f"{SECURITY_CVM_HOST}.",
        behavior="bypassResponsePolicy",
        opts=opts,
    )
    dev_subnet = gcp.compute.Subnetwork(
        f"{name}-dev",
        name=f"{prefix}-dev",
        project=project,
        region=region,
        network=vpc.id,
        ip_cidr_range=args.dev_cidr,
        private_ip_google_access=False,
        opts=opts,
    )
    sec_subnet = gcp.compute.Subnetwork(
        f"{name}-security",
        name=f"{prefix}-security",
        project=project,
        region=region,
        network=vpc.id,
        ip_cidr_range=args.security_cidr,
        private_ip_google_access=False,
        opts=opts,
    )
    gcp.compute.Route(
        f"{name}-security-egress-route",
        name=f"{prefix}-security-egress",
        project=project,
        network=vpc.id,
        dest_range="0.0.0.0/0",
        next_hop_gateway="default-internet-gateway",
        tags=[SECURITY_ROUTE_TAG],
        priority=1000,
        opts=opts,
    )
    # Dev CVMs: a route to each Console address only (untagged: routes select by tag, which
    # any instance admin can set, so the firewall's service-account rule below is the gate and
    # the route only bounds where a wrong rule could lead). Nothing else has a way out.
    consoles = console_hosts(args)
    for i, host in enumerate(consoles):
        gcp.compute.Route(
            f"{name}-dev-console-route-{i}",
            name=f"{prefix}-dev-console-{i}",
            project=project,
            network=vpc.id,
            dest_range=host,
            next_hop_gateway="default-internet-gateway",
            priority=1000,
            opts=opts,
        )
    # Security CVM egress: Cloud NAT on one static address (allow-listable by the sites the
    # proxy reaches, no inbound surface); the VM itself has no external address. The dev subnet
    # is translated only with Console routes, and then reaches only those /32s.
    router = gcp.compute.Router(
        f"{name}-router",
        name=f"{prefix}-router",
        project=project,
        region=region,
        network=vpc.id,
        opts=opts,
    )
    egress_ip = gcp.compute.Address(
        f"{name}-egress-ip",
        name=f"{prefix}-egress",
        project=project,
        region=region,
        address_type="EXTERNAL",
        labels={**labels, ROLE_LABEL: ROLE_SECURITY},
        opts=opts,
    )
    gcp.compute.RouterNat(
        f"{name}-nat",
        name=f"{prefix}-nat",
        project=project,
        region=region,
        router=router.name,
        nat_ip_allocate_option="MANUAL_ONLY",
        nat_ips=[egress_ip.self_link],
        source_subnetwork_ip_ranges_to_nat="LIST_OF_SUBNETWORKS",
        # The dev subnet only when it has Console routes: without them nothing of it gets here.
        subnetworks=[
            gcp.compute.RouterNatSubnetworkArgs(
                name=s.id, source_ip_ranges_to_nats=["ALL_IP_RANGES"]
            )
            for s in ([sec_subnet, dev_subnet] if consoles else [sec_subnet])
        ],
        log_config=gcp.compute.RouterNatLogConfigArgs(enable=args.log_denied, filter="ERRORS_ONLY"),
        opts=opts,
    )
    # Identities with no roles: the instances call no Google API.
    dev_sa = gcp.serviceaccount.Account(
        f"{name}-dev-sa",
        account_id=f"{prefix}-dev",
        display_name=f"Umbra Dev CVMs of team {args.team}",
        project=project,
        opts=opts,
    )
    sec_sa = gcp.serviceaccount.Account(
        f"{name}-security-sa",
        account_id=f"{prefix}-sec",
        display_name=f"Umbra Security CVM of team {args.team}",
        project=project,
        opts=opts,
    )

    def rule(
        suffix: str,
        *,
        direction: str,
        priority: int,
        target_service_accounts: list[pulumi.Output[str]],
        allows: list[gcp.compute.FirewallAllowArgs] | None = None,
        denies: list[gcp.compute.FirewallDenyArgs] | None = None,
        destination_ranges: list[str] | None = None,
        source_ranges: list[str] | None = None,
        source_service_accounts: list[pulumi.Output[str]] | None = None,
    ) -> None:
        # Deny logs cost per packet and a hostile agent can make many; on only when asked.
        log = args.log_denied and denies is not None
        gcp.compute.Firewall(
            f"{name}-{suffix}",
            name=f"{prefix}-{suffix}",
            # The policy pack reads the role from here: it is known at preview, emails are not.
            description=f"{ROLE_LABEL}={ROLE_DEV if suffix.startswith('dev-') else ROLE_SECURITY}",
            project=project,
            network=vpc.id,
            direction=direction,
            priority=priority,
            target_service_accounts=target_service_accounts,
            allows=allows,
            denies=denies,
            destination_ranges=destination_ranges,
            source_ranges=source_ranges,
            source_service_accounts=source_service_accounts,
            log_config=gcp.compute.FirewallLogConfigArgs(metadata="INCLUDE_ALL_METADATA")
            if log
            else None,
            opts=opts,
        )

    tcp = gcp.compute.FirewallAllowArgs
    rule(
        "dev-to-security",
        direction="EGRESS",
        priority=ALLOW_PRIORITY,
        target_service_accounts=[dev_sa.email],
        destination_ranges=[f"{security_ip}/32"],
        allows=[tcp(protocol="tcp", ports=[str(SECURITY_TUNNEL_PORT)])],
    )
    if consoles:
        rule(
            "dev-console-egress",
            direction="EGRESS",
            priority=ALLOW_PRIORITY,
            target_service_accounts=[dev_sa.email],
            destination_ranges=consoles,
            allows=[tcp(protocol="tcp", ports=[str(CONSOLE_PORT)])],
        )
    rule(
        "dev-deny-egress",
        direction="EGRESS",
        priority=DENY_ALL_PRIORITY,
        target_service_accounts=[dev_sa.email],
        destination_ranges=["0.0.0.0/0"],
        denies=[gcp.compute.FirewallDenyArgs(protocol="all")],
    )
    rule(
        "dev-attested-ssh",
        direction="INGRESS",
        priority=ALLOW_PRIORITY,
        target_service_accounts=[dev_sa.email],
        source_ranges=sorted(
            {*args.ssh_ingress_cidrs, *([IAP_RANGE] if args.reachability == "iap" else [])}
        ),
        allows=[tcp(protocol="tcp", ports=[str(DEV_ATTESTED_SSH_PORT)])],
    )
    # IAP TCP forwarding: who may open a tunnel, and only to the attested SSH port.
    for i, member in enumerate(args.iap_members if args.reachability == "iap" else ()):
        gcp.projects.IAMMember(
            f"{name}-iap-{i}",
            project=project,
            role="roles/iap.tunnelResourceAccessor",
            member=member,
            condition=gcp.projects.IAMMemberConditionArgs(
                title=f"{prefix}-attested-ssh-only",
                description="Umbra: IAP tunnels to the Dev CVMs' attested SSH port only",
                expression=f"destination.port == {DEV_ATTESTED_SSH_PORT}",
            ),
            opts=opts,
        )
    rule(
        "security-tunnel-in",
        direction="INGRESS",
        priority=ALLOW_PRIORITY,
        target_service_accounts=[sec_sa.email],
        source_service_accounts=[dev_sa.email],
        allows=[tcp(protocol="tcp", ports=[str(SECURITY_TUNNEL_PORT)])],
    )
    rule(
        "security-web-egress",
        direction="EGRESS",
        priority=ALLOW_PRIORITY,
        target_service_accounts=[sec_sa.email],
        destination_ranges=["0.0.0.0/0"],
        allows=[tcp(protocol="tcp", ports=[str(p) for p in SECURITY_EGRESS_PORTS])],
    )
    if args.security_replicas > 1:
        rule(
            "security-health-check",
            direction="INGRESS",
            priority=ALLOW_PRIORITY,
            target_service_accounts=[sec_sa.email],
            source_ranges=list(HEALTH_CHECK_RANGES),
            allows=[tcp(protocol="tcp", ports=[str(SECURITY_TUNNEL_PORT)])],
        )
    if args.security_dns_resolvers:
        rule(
            "security-dns-egress",
            direction="EGRESS",
            priority=ALLOW_PRIORITY,
            target_service_accounts=[sec_sa.email],
            destination_ranges=[f"{ip}/32" for ip in args.security_dns_resolvers],
            allows=[tcp(protocol="udp", ports=["53"]), tcp(protocol="tcp", ports=["53"])],
        )
    if args.console_cidrs:
        rule(
            "security-console-egress",
            direction="EGRESS",
            priority=ALLOW_PRIORITY,
            target_service_accounts=[sec_sa.email],
            destination_ranges=list(args.console_cidrs),
            allows=[tcp(protocol="tcp", ports=[str(args.console_port)])],
        )
    rule(
        "security-deny-egress",
        direction="EGRESS",
        priority=DENY_ALL_PRIORITY,
        target_service_accounts=[sec_sa.email],
        destination_ranges=["0.0.0.0/0"],
        denies=[gcp.compute.FirewallDenyArgs(protocol="all")],
    )
    return NetworkParts(
        network_id=vpc.id,
        dev_subnet_id=dev_subnet.id,
        security_subnet_id=sec_subnet.id,
        dev_identity=dev_sa.email,
        security_identity=sec_sa.email,
        egress_ip=egress_ip.address,
    )
