"""What `pulumi up` would have hit, under mocks against the installed provider SDKs: Azure service
tags in list fields, replacement of fixed-name VMs without delete-before-replace, Azure custom
data without a replacement rule, name collisions between team-stack and Console Dev CVMs, fresh
GCP projects, non-TDX sizes, DNS as an open channel, public IPs on the Security CVM, deny-rule
logging, and labels."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.infra.harness import ROOT, Recorder, azure_allows, example_stack, raw_of, run_program
from umbra.components.azure_network import _prefixes
from umbra.components.config import ConfigError, TeamStack, parse_stack_config
from umbra.components.naming import Owner, dev_cvm_name
from umbra.components.ports import SECURITY_CVM_HOST
from umbra.components.program import build_team

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

INSTANCE = "gcp:compute/instance:Instance"
GCP_DISK = "gcp:compute/disk:Disk"
VM = "azure-native:compute:VirtualMachine"
AZ_DISK = "azure-native:compute:Disk"
NSG = "azure-native:network:NetworkSecurityGroup"
OTHER_KEY = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID96kVJKpTvwbrseNqZ/ZA5GO9l+k9k/SdivXU4WFBla new@laptop"
)


def team(stack: dict[str, Any]) -> Recorder:
    cfg = parse_stack_config(raw_of(stack), frozenset())
    assert isinstance(cfg, TeamStack)
    mocks, _ = run_program(lambda: build_team(cfg, ROOT / "no-such-root").security.instance_id)
    return mocks


@pytest.fixture(scope="module")
def acme() -> Recorder:
    return team(example_stack("acme-gcp"))


@pytest.fixture(scope="module")
def globex() -> Recorder:
    return team(example_stack("globex-azure"))


# --- Azure NSG: service tags only in the single-value fields -----------------------------------


def test_no_nsg_rule_puts_a_service_tag_in_a_list_field(globex: Recorder) -> None:
    tagged = []
    for nsg in globex.of_type(NSG):
        for rule in nsg.inputs["securityRules"]:
            for side in ("source", "destination"):
                for prefix in rule.get(f"{side}AddressPrefixes", []):
                    assert prefix[0].isdigit(), f"{nsg.name}/{rule['name']}: {prefix!r} in a list"
                if rule.get(f"{side}AddressPrefix", "")[:1].isalpha():
                    tagged.append((rule["name"], rule[f"{side}AddressPrefix"]))
    assert ("web-egress", "Internet") in tagged
    assert ("deny-platform-dns", "AzurePlatformDNS") in tagged
    with pytest.raises(ValueError, match="service tags"):
        _prefixes("destination", ["Internet", "10.0.0.0/8"])


# --- replacement on launch-data change ----------------------------------------------------------


def test_gcp_instances_are_deleted_before_their_replacement(acme: Recorder) -> None:
    for inst in acme.of_type(INSTANCE):
        opts = acme.options[(INSTANCE, inst.name)]
        assert opts.delete_before_replace is True, inst.name
        assert opts.replace_on_changes == ["metadata"], inst.name


def test_azure_vms_replace_on_user_data_deleting_first(globex: Recorder) -> None:
    for vm in globex.of_type(VM):
        opts = globex.options[(VM, vm.name)]
        assert opts.replace_on_changes == ["userData"], vm.name
        assert opts.delete_before_replace is True, vm.name


@pytest.mark.parametrize(
    ("stack", "vm_type", "disk_type", "launch_field"),
    [
        ("acme-gcp", INSTANCE, GCP_DISK, "metadata"),
        ("globex-azure", VM, AZ_DISK, "userData"),
    ],
)
def test_the_developer_disk_survives_a_launch_data_change(
    stack: str, vm_type: str, disk_type: str, launch_field: str
) -> None:
    before = example_stack(stack)
    after = copy.deepcopy(before)
    after["developers"][0]["ssh_keys"] = [OTHER_KEY]
    dev = f"{before['team']}-{before['developers'][0]['name']}-main"
    runs = [team(before), team(after)]
    vms = [r.one(vm_type, dev).inputs for r in runs]
    disks = [r.one(disk_type, f"{dev}-data").inputs for r in runs]
    # The launch data changed (so the VM is replaced); the disk's inputs did not (so it stays).
    assert vms[0][launch_field] != vms[1][launch_field]
    assert disks[0] == disks[1]
    assert runs[1].options[(disk_type, f"{dev}-data")].replace_on_changes in (None, [])
    if vm_type == INSTANCE:
        assert vms[1]["attachedDisks"] == [
            {
                "source": f"zones/us-central1-a/disks/{disks[1]['name']}",
                "deviceName": "umbra-data",
                "mode": "READ_WRITE",
            }
        ]
        assert vms[1]["bootDisk"]["autoDelete"] is True  # the boot disk is disposable
    else:
        (data,) = vms[1]["storageProfile"]["dataDisks"]
        assert data["createOption"] == "Attach" and data["deleteOption"] == "Detach"


# --- one name per owner -------------------------------------------------------------------------


def test_team_stack_and_console_dev_cvms_never_share_a_cloud_name() -> None:
    stack = dev_cvm_name("acme", "alice", "main", Owner.TEAM_STACK)
    console = dev_cvm_name("acme", "alice", "main", Owner.CONSOLE)
    assert stack != console
    assert stack.startswith("umbra-acme-alice-main-s") and console.startswith(
        "umbra-acme-alice-main-c"
    )
    # Dashes inside names cannot make two different owners' triples collide either.
    assert dev_cvm_name("a-b", "c", "main", Owner.TEAM_STACK) != dev_cvm_name(
        "a", "b-c", "main", Owner.TEAM_STACK
    )
    longest = dev_cvm_name("a" * 16, "b" * 16, "c" * 16, Owner.CONSOLE)
    assert len(longest) <= 63 and longest[-1].isalnum()


def test_the_team_program_names_its_dev_cvms_with_the_naming_function(acme: Recorder) -> None:
    names = {i.inputs["name"] for i in acme.of_type(INSTANCE)}
    assert dev_cvm_name("acme", "alice", "scratch", Owner.TEAM_STACK) in names
    assert "umbra-acme-sec" in names


# --- fresh projects and TDX machine types -------------------------------------------------------


def test_a_fresh_gcp_project_gets_its_apis_enabled_first(acme: Recorder) -> None:
    services = acme.of_type("gcp:projects/service:Service")
    assert sorted(s.inputs["service"] for s in services) == [
        "compute.googleapis.com",
        "dns.googleapis.com",
        "iam.googleapis.com",
    ]
    assert all(s.inputs["disableOnDestroy"] is False for s in services)
    vpc_opts = acme.options[("gcp:compute/network:Network", "acme-vpc")]
    assert len(vpc_opts.depends_on or []) == 3  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cloud_stack", "size", "ok"),
    [
        ("acme-gcp", "c3-standard-8", True),
        ("acme-gcp", "c3-highcpu-4", False),
        ("acme-gcp", "n2d-standard-4", False),
        ("acme-gcp", "c3d-standard-4", False),
        ("globex-azure", "Standard_DC4es_v5", True),
        ("globex-azure", "Standard_EC16eds_v5", True),
        ("globex-azure", "Standard_DC8es_v6", True),
        ("globex-azure", "Standard_DC4as_v5", False),
        ("globex-azure", "Standard_D4s_v5", False),
    ],
)
def test_only_tdx_machine_types_are_accepted(cloud_stack: str, size: str, ok: bool) -> None:
    stack = example_stack(cloud_stack)
    stack["dev_cvm"]["size"] = size
    if ok:
        parse_stack_config(raw_of(stack), frozenset())
    else:
        with pytest.raises(ConfigError, match=r"dev_cvm.size .* is not a TDX"):
            parse_stack_config(raw_of(stack), frozenset())


# --- DNS closed at the cloud --------------------------------------------------------------------


def test_gcp_team_vpc_resolves_nothing_but_the_security_cvm(acme: Recorder) -> None:
    (policy,) = acme.of_type("gcp:dns/responsePolicy:ResponsePolicy")
    assert policy.inputs["networks"] == [{"networkUrl": "acme-vpc-id"}]
    rules = {
        r.inputs["dnsName"]: r.inputs
        for r in acme.of_type("gcp:dns/responsePolicyRule:ResponsePolicyRule")
    }
    assert rules["*."]["localData"]["localDatas"] == [
        {"name": "*.", "type": "A", "ttl": 300, "rrdatas": ["0.0.0.0"]}  # noqa: S104
    ]
    assert rules[f"{SECURITY_CVM_HOST}."]["behavior"] == "bypassResponsePolicy"
    assert len(rules) == 2


def test_azure_team_vnet_resolves_nothing_but_the_private_zone(globex: Recorder) -> None:
    (link,) = globex.of_type("azure-native:dnsresolver:DnsResolverPolicyVirtualNetworkLink")
    assert link.inputs["virtualNetwork"] == {"id": "globex-vnet-id"}
    lists = {
        d.name: d.inputs["domains"]
        for d in globex.of_type("azure-native:dnsresolver:DnsResolverDomainList")
    }
    rules = sorted(
        (
            r.inputs["priority"],
            r.inputs["action"]["actionType"],
            r.inputs["dnsResolverDomainLists"][0]["id"],
        )
        for r in globex.of_type("azure-native:dnsresolver:DnsSecurityRule")
    )
    assert rules == [
        (100, "Allow", "globex-dns-private-id"),
        (1000, "Block", "globex-dns-everything-id"),
    ]
    assert lists == {"globex-dns-private": ["umbra.internal."], "globex-dns-everything": ["."]}
    dev_nsg = globex.one(NSG, "globex-dev-nsg")
    assert not azure_allows(
        dev_nsg, direction="Outbound", src="10.30.0.5", dst="168.63.129.16", port=53
    )


def test_dev_cvms_get_the_host_firewall_and_no_dns_need(acme: Recorder, globex: Recorder) -> None:
    meta = acme.one(INSTANCE, "acme-alice-main").inputs["metadata"]
    assert meta["umbra-security-cvm-ips"] == "10.20.1.10"
    ruleset = meta["umbra-host-firewall"]
    assert "ip daddr { 10.20.1.10 } tcp dport 8443 ct state new accept" in ruleset
    assert "th dport 53 counter drop" in ruleset
    sec_meta = acme.one(INSTANCE, "acme-security").inputs["metadata"]
    assert "umbra-host-firewall" not in sec_meta
    assert sec_meta["umbra-dns-resolvers"] == "8.8.8.8 1.1.1.1"


# --- Security CVM egress through NAT; logging -----------------------------------------------------


def test_gcp_security_egress_is_cloud_nat_on_a_static_address(acme: Recorder) -> None:
    (nat,) = acme.of_type("gcp:compute/routerNat:RouterNat")
    (addr,) = acme.of_type("gcp:compute/address:Address")
    assert nat.inputs["natIpAllocateOption"] == "MANUAL_ONLY"
    assert nat.inputs["sourceSubnetworkIpRangesToNat"] == "LIST_OF_SUBNETWORKS"
    # The dev subnet too: it has routes to the Console's /32s only (console_ips).
    assert nat.inputs["subnetworks"] == [
        {"name": "acme-security-id", "sourceIpRangesToNats": ["ALL_IP_RANGES"]},
        {"name": "acme-dev-id", "sourceIpRangesToNats": ["ALL_IP_RANGES"]},
    ]
    assert addr.inputs["addressType"] == "EXTERNAL"
    assert all(
        not i.inputs["networkInterfaces"][0].get("accessConfigs") for i in acme.of_type(INSTANCE)
    )


def test_azure_security_egress_is_a_nat_gateway_on_the_security_subnet(globex: Recorder) -> None:
    (nat,) = globex.of_type("azure-native:network:NatGateway")
    assert nat.inputs["publicIpAddresses"] == [{"id": "globex-egress-ip-id"}]
    subnets = {s.name: s.inputs for s in globex.of_type("azure-native:network:Subnet")}
    assert subnets["globex-security"]["natGateway"] == {"id": "globex-nat-id"}
    # The dev subnet too, behind a route table that drops all but the Console (console_ips).
    assert subnets["globex-dev"]["natGateway"] == {"id": "globex-nat-id"}
    assert subnets["globex-dev"]["routeTable"] == {"id": "globex-dev-routes-id"}
    (pip,) = globex.of_type("azure-native:network:PublicIPAddress")
    assert pip.name == "globex-egress-ip"


def test_deny_logging_is_off_by_default_and_on_when_asked(acme: Recorder) -> None:
    firewalls = acme.of_type("gcp:compute/firewall:Firewall")
    assert not any("logConfig" in f.inputs for f in firewalls)
    stack = example_stack("acme-gcp")
    stack["network"]["log_denied"] = True
    logged = {
        f.name
        for f in team(stack).of_type("gcp:compute/firewall:Firewall")
        if "logConfig" in f.inputs
    }
    assert logged == {"acme-dev-deny-egress", "acme-security-deny-egress"}


def test_security_cvm_reaches_only_its_named_resolvers_on_53(acme: Recorder) -> None:
    fw = acme.one("gcp:compute/firewall:Firewall", "acme-security-dns-egress").inputs
    assert fw["destinationRanges"] == ["8.8.8.8/32", "1.1.1.1/32"]
    stack = example_stack("acme-gcp")
    stack["network"]["security_dns_resolvers"] = ["10.0.0.2"]
    with pytest.raises(ConfigError, match=r"security_dns_resolvers\[0\]: 10.0.0.2 is not a public"):
        parse_stack_config(raw_of(stack), frozenset())


# --- labels -----------------------------------------------------------------------------------------


def test_every_labelled_resource_carries_team_role_developer_and_cost_centre() -> None:
    for name in ("acme-gcp", "globex-azure"):
        stack = example_stack(name)
        stack["cost_centre"] = "cc-42"
        mocks = team(stack)
        key = "labels" if name == "acme-gcp" else "tags"
        labelled = [r for r in mocks.resources if key in r.inputs]
        assert len(labelled) > 5
        for r in labelled:
            assert r.inputs[key]["umbra-team"] == stack["team"], r.name
            assert r.inputs[key]["umbra-cost-centre"] == "cc-42", r.name
        first = stack["developers"][0]["name"]
        dev = next(r for r in labelled if r.name == f"{stack['team']}-{first}-main")
        assert dev.inputs[key]["umbra-developer"] == first
        assert dev.inputs[key]["umbra-role"] == "dev-cvm"


# --- reachability of the attested SSH port ------------------------------------------------------


def test_gcp_iap_reachability_opens_8022_to_iap_and_grants_only_that_port() -> None:
    stack = example_stack("acme-gcp")
    stack["network"] |= {"reachability": "iap", "iap_members": ["group:acme-devs@example.com"]}
    mocks = team(stack)
    ssh = mocks.one("gcp:compute/firewall:Firewall", "acme-dev-attested-ssh").inputs
    assert "35.235.240.0/20" in ssh["sourceRanges"]
    assert ssh["allows"] == [{"protocol": "tcp", "ports": ["8022"]}]
    (grant,) = mocks.of_type("gcp:projects/iAMMember:IAMMember")
    assert grant.inputs["role"] == "roles/iap.tunnelResourceAccessor"
    assert grant.inputs["member"] == "group:acme-devs@example.com"
    assert grant.inputs["condition"]["expression"] == "destination.port == 8022"
    services = {s.inputs["service"] for s in mocks.of_type("gcp:projects/service:Service")}
    assert "iap.googleapis.com" in services


def test_azure_bastion_reachability_admits_8022_from_the_bastion_subnet_only() -> None:
    stack = example_stack("globex-azure")
    stack["network"] |= {"reachability": "bastion", "bastion_cidr": "10.30.2.0/26"}
    mocks = team(stack)
    (host,) = mocks.of_type("azure-native:network:BastionHost")
    assert host.inputs["enableTunneling"] is True and host.inputs["sku"] == {"name": "Standard"}
    subnet = mocks.one("azure-native:network:Subnet", "globex-bastion").inputs
    assert subnet["subnetName"] == "AzureBastionSubnet"
    dev_nsg = mocks.one(NSG, "globex-dev-nsg")
    assert azure_allows(dev_nsg, direction="Inbound", src="10.30.2.5", dst="10.30.0.4", port=8022)
    assert not azure_allows(dev_nsg, direction="Inbound", src="10.30.2.5", dst="10.30.0.4", port=22)


@pytest.mark.parametrize(
    ("stack_name", "network", "message"),
    [
        ("acme-gcp", {"reachability": "iap"}, "reachability 'iap' needs iap_members"),
        (
            "acme-gcp",
            {"reachability": "bastion", "bastion_cidr": "10.20.2.0/26"},
            "does not exist on gcp",
        ),
        ("globex-azure", {"reachability": "bastion"}, "needs bastion_cidr"),
        ("globex-azure", {"reachability": "bastion", "bastion_cidr": "10.30.0.0/26"}, "overlaps"),
        (
            "globex-azure",
            {"iap_members": ["user:a@example.com"]},
            "only used with reachability 'iap'",
        ),
    ],
)
def test_reachability_config_errors_are_precise(
    stack_name: str, network: dict[str, Any], message: str
) -> None:
    stack = example_stack(stack_name)
    stack["network"] |= network
    with pytest.raises(ConfigError, match=message):
        parse_stack_config(raw_of(stack), frozenset())


# --- Security CVM replicas ----------------------------------------------------------------------


def test_security_cvm_replicas_sit_behind_an_internal_passthrough_lb_on_the_fixed_address() -> None:
    stack = example_stack("acme-gcp")
    stack["security_cvm"]["replicas"] = 3
    mocks = team(stack)
    secs = sorted(
        (i.inputs["name"], i.inputs["networkInterfaces"][0]["networkIp"])
        for i in mocks.of_type(INSTANCE)
        if i.inputs["labels"]["umbra-role"] == "security-cvm"
    )
    assert secs == [
        ("umbra-acme-sec", "10.20.1.11"),
        ("umbra-acme-sec-1", "10.20.1.12"),
        ("umbra-acme-sec-2", "10.20.1.13"),
    ]
    (rule,) = mocks.of_type("gcp:compute/forwardingRule:ForwardingRule")
    assert rule.inputs["ipAddress"] == "10.20.1.10"  # what Dev CVMs dial, unchanged
    assert rule.inputs["loadBalancingScheme"] == "INTERNAL"
    assert rule.inputs["ports"] == ["8443"]
    (backend,) = mocks.of_type("gcp:compute/regionBackendService:RegionBackendService")
    assert backend.inputs["protocol"] == "TCP" and backend.inputs["sessionAffinity"] == "CLIENT_IP"
    (group,) = mocks.of_type("gcp:compute/instanceGroup:InstanceGroup")
    assert len(group.inputs["instances"]) == 3
    meta = mocks.one(INSTANCE, "acme-security-2").inputs["metadata"]
    assert meta["umbra-lb-ip"] == "10.20.1.10"
    dev_meta = mocks.one(INSTANCE, "acme-alice-main").inputs["metadata"]
    assert dev_meta["umbra-security-cvm-ips"] == "10.20.1.10"
    hc = mocks.one("gcp:compute/firewall:Firewall", "acme-security-health-check").inputs
    assert hc["sourceRanges"] == ["35.191.0.0/16", "130.211.0.0/22"]


def test_replicas_must_fit_in_the_security_range() -> None:
    stack = example_stack("acme-gcp")
    stack["security_cvm"]["replicas"] = 4
    with pytest.raises(ConfigError, match=r"do not fit in security_cidr 10.20.1.0/28 .* at most 3"):
        parse_stack_config(raw_of(stack), frozenset())


def test_azure_replicas_sit_behind_an_internal_standard_lb_on_the_fixed_address() -> None:
    stack = example_stack("globex-azure")
    stack["security_cvm"]["replicas"] = 2
    mocks = team(stack)
    (lb,) = mocks.of_type("azure-native:network:LoadBalancer")
    (front,) = lb.inputs["frontendIPConfigurations"]
    assert front["privateIPAddress"] == "10.30.1.10"
    assert front["privateIPAllocationMethod"] == "Static"
    (rule,) = lb.inputs["loadBalancingRules"]
    assert (rule["frontendPort"], rule["backendPort"], rule["protocol"]) == (8443, 8443, "Tcp")
    assert rule["loadDistribution"] == "SourceIP"
    lb_id = "/subscriptions/sub-0000/resourceGroups/globex-rg/providers/Microsoft.Network/loadBalancers/umbra-globex-sec"
    assert rule["probe"] == {"id": f"{lb_id}/probes/tunnel"}
    nics = {
        n.name: n.inputs["ipConfigurations"][0]
        for n in mocks.of_type("azure-native:network:NetworkInterface")
    }
    for name, ip in (
        ("globex-security-nic", "10.30.1.11"),
        ("globex-security-1-nic", "10.30.1.12"),
    ):
        assert nics[name]["privateIPAddress"] == ip
        assert nics[name]["loadBalancerBackendAddressPools"] == [
            {"id": "globex-security-lb-id/backendAddressPools/replicas"}
        ]
    assert "loadBalancerBackendAddressPools" not in nics["globex-carol-main-nic"]
    sec_nsg = mocks.one(NSG, "globex-security-nsg")
    # The LB rewrites the destination to the replica; its probe comes from AzureLoadBalancer.
    assert azure_allows(sec_nsg, direction="Inbound", src="10.30.0.5", dst="10.30.1.12", port=8443)
    assert not azure_allows(
        sec_nsg, direction="Inbound", src="10.30.0.5", dst="10.30.1.12", port=22
    )


# --- stacks that know each other ----------------------------------------------------------------


def test_a_team_stack_reads_the_console_url_and_ca_from_the_console_stack() -> None:
    stack = example_stack("acme-gcp")
    del stack["console_url"]
    stack["console_stack"] = "umbra-org/umbra/console-gcp"
    cfg = parse_stack_config(raw_of(stack), frozenset())
    assert isinstance(cfg, TeamStack)
    ca = "-----BEGIN CERTIFICATE-----\nconsole\n-----END CERTIFICATE-----\n"
    outputs = {"console_url": "https://console.umbra.example.com", "console_ca_pem": ca}
    mocks, _ = run_program(
        lambda: build_team(cfg, ROOT).security.instance_id, stack_outputs=outputs
    )
    (ref,) = mocks.of_type("pulumi:pulumi:StackReference")
    assert ref.inputs["name"] == "umbra-org/umbra/console-gcp"
    meta = mocks.one(INSTANCE, "acme-security").inputs["metadata"]
    assert meta["umbra-console-url"] == "https://console.umbra.example.com"
    assert meta["umbra-console-ca"] == ca
    both = example_stack("acme-gcp") | {"console_stack": "umbra-org/umbra/console-gcp"}
    with pytest.raises(ConfigError, match="exactly one of console_url and console_stack"):
        parse_stack_config(raw_of(both), frozenset())


@pytest.mark.parametrize(
    ("stack", "disk_type"), [("acme-gcp", GCP_DISK), ("globex-azure", AZ_DISK)]
)
def test_the_security_cvm_has_a_data_disk_for_its_spool(stack: str, disk_type: str) -> None:
    """Fails before the fix: the Security CVM had no data disk, its spool lived on tmpfs."""
    from umbra.components.cvm import SECURITY_DATA_DISK_GB

    run = team(example_stack(stack))
    name = f"{example_stack(stack)['team']}-security-data"
    disk = run.one(disk_type, name).inputs
    assert disk.get("size", disk.get("diskSizeGB")) == SECURITY_DATA_DISK_GB


def test_reachability_public_is_refused_with_the_reason() -> None:
    """Fails before the fix: `public` was the default and opened 8022 to an address the VM does
    not have (no Dev CVM has a public IP). `private` says what it reaches."""
    from umbra.components.config import NetworkConfig

    stack = copy.deepcopy(example_stack("globex-azure"))
    assert parse_stack_config(raw_of(stack), frozenset()).network.reachability == "private"  # type: ignore[union-attr]
    stack["network"] |= {"reachability": "public"}
    with pytest.raises(Exception, match="reachability 'public' is gone: no Dev CVM has a public"):
        parse_stack_config(raw_of(stack), frozenset())
    assert "private" in str(NetworkConfig.model_fields["reachability"].annotation)
