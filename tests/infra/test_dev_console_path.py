"""A Dev CVM's one way out besides its Security CVM: tcp 443 to the Console's declared addresses
(its forwarder enrolls there once), on both clouds, under mocks. The rule, the route and the NAT
exist exactly for those /32s; without `console_ips` there is none of them, and the program says
Dev CVMs cannot enroll."""

from __future__ import annotations

from typing import Any

import pulumi
import pytest

from tests.infra.harness import (
    ROOT,
    Recorder,
    azure_allows,
    example_stack,
    gcp_allows,
    raw_of,
    run_program,
)
from umbra.components.config import (
    AzurePlacement,
    ConfigError,
    GcpPlacement,
    TeamStack,
    parse_stack_config,
)
from umbra.components.network import TeamNetwork, TeamNetworkArgs
from umbra.components.program import NO_CONSOLE_IPS_WARNING, build_team

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONSOLES = ["203.0.113.7", "198.51.100.20"]
DEV_SA = "umbra-t-dev@acme-umbra.iam.gserviceaccount.com"
FIREWALL = "gcp:compute/firewall:Firewall"
ROUTE = "gcp:compute/route:Route"
NAT = "gcp:compute/routerNat:RouterNat"
NSG = "azure-native:network:NetworkSecurityGroup"
SUBNET = "azure-native:network:Subnet"
ROUTE_TABLE = "azure-native:network:RouteTable"


def _network(cloud: str, consoles: list[str]) -> Recorder:
    args = TeamNetworkArgs(
        team="t",
        cloud="gcp" if cloud == "gcp" else "azure",
        dev_cidr="10.40.0.0/24",
        security_cidr="10.40.1.0/28",
        ssh_ingress_cidrs=["35.235.240.0/20"],
        gcp=GcpPlacement(project="acme-umbra", region="us-central1", zone="us-central1-a")
        if cloud == "gcp"
        else None,
        azure=AzurePlacement(location="westeurope") if cloud == "azure" else None,
        dev_console_ips=consoles,
    )
    mocks, _ = run_program(lambda: TeamNetwork("t", args).network_id)
    return mocks


@pytest.fixture(scope="module")
def nets() -> dict[tuple[str, bool], Recorder]:
    return {
        (cloud, with_console): _network(cloud, CONSOLES if with_console else [])
        for cloud in ("gcp", "azure")
        for with_console in (True, False)
    }


# --- GCP ------------------------------------------------------------------------------------------


def test_gcp_dev_console_rule_is_exactly_tcp_443_to_the_console_hosts(
    nets: dict[tuple[str, bool], Recorder],
) -> None:
    mocks = nets[("gcp", True)]
    rule = mocks.one(FIREWALL, "t-dev-console-egress").inputs
    assert rule["direction"] == "EGRESS"
    assert rule["targetServiceAccounts"] == [DEV_SA]
    assert rule["destinationRanges"] == ["198.51.100.20/32", "203.0.113.7/32"]
    assert rule["allows"] == [{"protocol": "tcp", "ports": ["443"]}]
    assert "denies" not in rule or not rule["denies"]
    deny = mocks.one(FIREWALL, "t-dev-deny-egress").inputs
    assert rule["priority"] < deny["priority"]  # evaluated before the deny-all
    # Flow by flow, GCP semantics over every rule of the network.
    fws = mocks.of_type(FIREWALL)

    def egress(ip: str, port: int) -> bool:
        return gcp_allows(fws, direction="EGRESS", target_sa=DEV_SA, peer_ip=ip, port=port)

    assert egress("203.0.113.7", 443) and egress("198.51.100.20", 443)
    assert egress("10.40.1.10", 8443)  # the tunnel is unchanged
    for ip, port in [
        ("203.0.113.7", 80),
        ("203.0.113.7", 8443),
        ("203.0.113.7", 22),
        ("203.0.113.8", 443),  # the Console's neighbour
        ("8.8.8.8", 443),
        ("169.254.169.254", 443),
    ]:
        assert not egress(ip, port), (ip, port)


def test_gcp_routes_and_nat_reach_only_the_console_hosts(
    nets: dict[tuple[str, bool], Recorder],
) -> None:
    mocks = nets[("gcp", True)]
    routes = {r.inputs["destRange"]: r.inputs for r in mocks.of_type(ROUTE)}
    assert set(routes) == {"0.0.0.0/0", "198.51.100.20/32", "203.0.113.7/32"}
    assert routes["0.0.0.0/0"]["tags"] == ["umbra-security-cvm"]
    for host in ("198.51.100.20/32", "203.0.113.7/32"):
        assert routes[host]["nextHopGateway"] == "default-internet-gateway"
    (nat,) = mocks.of_type(NAT)
    assert [s["name"] for s in nat.inputs["subnetworks"]] == ["t-security-id", "t-dev-id"]


def test_gcp_without_console_ips_the_dev_cvm_has_only_the_tunnel(
    nets: dict[tuple[str, bool], Recorder],
) -> None:
    mocks = nets[("gcp", False)]
    assert not [r for r in mocks.of_type(FIREWALL) if "console" in r.name]
    assert [r.inputs["tags"] for r in mocks.of_type(ROUTE)] == [["umbra-security-cvm"]]
    (nat,) = mocks.of_type(NAT)
    assert [s["name"] for s in nat.inputs["subnetworks"]] == ["t-security-id"]


# --- Azure ----------------------------------------------------------------------------------------


def test_azure_dev_nsg_allows_exactly_tcp_443_to_the_console_hosts(
    nets: dict[tuple[str, bool], Recorder],
) -> None:
    mocks = nets[("azure", True)]
    nsg = mocks.one(NSG, "t-dev-nsg")
    rule = next(r for r in nsg.inputs["securityRules"] if r["name"] == "to-console")
    assert (rule["direction"], rule["access"], rule["protocol"]) == ("Outbound", "Allow", "Tcp")
    assert rule["destinationAddressPrefixes"] == ["198.51.100.20/32", "203.0.113.7/32"]
    assert rule["destinationPortRanges"] == ["443"]
    deny = next(r for r in nsg.inputs["securityRules"] if r["name"] == "deny-all-outbound")
    assert rule["priority"] < deny["priority"]

    def out(dst: str, port: int) -> bool:
        return azure_allows(nsg, direction="Outbound", src="10.40.0.5", dst=dst, port=port)

    assert out("203.0.113.7", 443) and out("198.51.100.20", 443) and out("10.40.1.10", 8443)
    for dst, port in [("203.0.113.7", 80), ("203.0.113.8", 443), ("8.8.8.8", 443)]:
        assert not out(dst, port), (dst, port)


def test_azure_dev_subnet_gets_nat_and_routes_only_to_the_console(
    nets: dict[tuple[str, bool], Recorder],
) -> None:
    mocks = nets[("azure", True)]
    subnets = {s.name: s.inputs for s in mocks.of_type(SUBNET)}
    assert subnets["t-dev"]["natGateway"] == {"id": "t-nat-id"}
    assert subnets["t-dev"]["routeTable"] == {"id": "t-dev-routes-id"}
    (table,) = mocks.of_type(ROUTE_TABLE)
    assert sorted((r["addressPrefix"], r["nextHopType"]) for r in table.inputs["routes"]) == [
        ("0.0.0.0/0", "None"),
        ("198.51.100.20/32", "Internet"),
        ("203.0.113.7/32", "Internet"),
    ]


def test_azure_without_console_ips_the_dev_subnet_has_no_way_out(
    nets: dict[tuple[str, bool], Recorder],
) -> None:
    mocks = nets[("azure", False)]
    subnets = {s.name: s.inputs for s in mocks.of_type(SUBNET)}
    assert "natGateway" not in subnets["t-dev"] and "routeTable" not in subnets["t-dev"]
    assert not mocks.of_type(ROUTE_TABLE)
    nsg = mocks.one(NSG, "t-dev-nsg")
    assert "to-console" not in [r["name"] for r in nsg.inputs["securityRules"]]


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ips", "message"),
    [
        (["203.0.113.0/24"], "is not a valid IPv4 address"),
        (["0.0.0.0"], "is not a host the Console can be reached at"),  # noqa: S104
        (["169.254.169.254"], "is not a host the Console can be reached at"),
        (["127.0.0.1"], "is not a host the Console can be reached at"),
        (["240.0.0.1"], "is a reserved address"),
        (["10.20.1.11"], "is inside network.security_cidr"),
        (["10.20.0.9"], "is inside network.dev_cidr"),
        (["203.0.113.7", "203.0.113.7"], "lists an address twice"),
    ],
)
def test_bad_console_ips_are_refused_with_the_key(ips: list[str], message: str) -> None:
    doc: dict[str, Any] = example_stack("acme-gcp") | {"console_ips": ips}
    with pytest.raises(ConfigError, match="console_ips") as err:
        parse_stack_config(raw_of(doc), frozenset())
    assert message in str(err.value)


@pytest.mark.parametrize("ip", ["203.0.113.0/24", "0.0.0.0", "10.40.1.12"])  # noqa: S104
def test_team_network_args_refuse_what_config_refuses(ip: str) -> None:
    with pytest.raises(ValueError, match=r"^dev_console_ips: "):
        TeamNetworkArgs(
            team="t",
            cloud="gcp",
            dev_cidr="10.40.0.0/24",
            security_cidr="10.40.1.0/28",
            ssh_ingress_cidrs=["35.235.240.0/20"],
            gcp=GcpPlacement(project="acme-umbra", region="us-central1", zone="us-central1-a"),
            dev_console_ips=[ip],
        )


def test_a_team_without_console_ips_is_warned_that_dev_cvms_cannot_enroll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    doc: dict[str, Any] = example_stack("acme-gcp") | {"console_ips": [], "developers": []}
    cfg = parse_stack_config(raw_of(doc), frozenset())
    assert isinstance(cfg, TeamStack)
    warned: list[str] = []
    monkeypatch.setattr(pulumi.log, "warn", lambda msg, *a, **k: warned.append(msg))
    mocks, _ = run_program(lambda: build_team(cfg, ROOT).security.instance_id)
    assert NO_CONSOLE_IPS_WARNING in warned
    assert "console_ips is empty: Dev CVMs cannot enroll" in NO_CONSOLE_IPS_WARNING
    assert not [r for r in mocks.of_type(FIREWALL) if "console" in r.name]


@pytest.mark.parametrize("cidr", ["198.18.0.0/24", "192.0.2.0/24", "100.64.0.0/24"])
def test_team_ranges_are_rfc1918_as_the_policy_pack_counts_them(cidr: str) -> None:
    # Python's is_private counts these; the pack would refuse the tunnel rule to them.
    doc: dict[str, Any] = example_stack("acme-gcp")
    doc["network"] = doc["network"] | {"security_cidr": cidr}
    with pytest.raises(ConfigError, match="is not a private range"):
        parse_stack_config(raw_of(doc), frozenset())
