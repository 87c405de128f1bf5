"""The policy pack's rules: everything our programs build passes; each way of breaking TDX, the
Dev CVM's isolation or SSH exposure is refused, through the pack's ResourceValidationPolicies."""

from __future__ import annotations

import copy
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

import pytest
from pulumi_policy import PolicyCustomTimeouts, PolicyResourceOptions, ResourceValidationArgs

from tests.infra.harness import ROOT, Recorder, example_raw, run_program
from umbra.components import ports
from umbra.components.config import TeamStack, parse_stack_config
from umbra.components.program import build_team

# The pack is not a package of the distribution: load its rules module the way Pulumi does.
sys.path.insert(0, str(ROOT / "infra" / "policy_pack"))
rules: Any = importlib.import_module("umbra_policy_rules")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

POLICIES = {p.name: p for p in rules.policies()}


def pack_config(stack: str) -> dict[str, Any]:
    """The example `--policy-pack-config` file of a stack (stacks/policy-pack.<stack>.json)."""
    doc: dict[str, Any] = json.loads((ROOT / "stacks" / f"policy-pack.{stack}.json").read_text())
    return doc


def violations(
    resource_type: str, props: dict[str, Any], config: dict[str, Any] | None = None
) -> dict[str, list[str]]:
    """Run every policy of the pack on one resource, as the engine would, each policy with its
    part of the pack config (as `--policy-pack-config` hands it over)."""
    opts = PolicyResourceOptions(False, [], None, [], PolicyCustomTimeouts(0, 0, 0), [])
    out: dict[str, list[str]] = {}
    for name, policy in POLICIES.items():
        args = ResourceValidationArgs(
            resource_type,
            props,
            "urn:pulumi:t::umbra::x",
            "x",
            opts,
            None,
            (config or {}).get(name),
        )
        seen: list[str] = []
        policy.validate(args, lambda msg, urn=None, seen=seen: seen.append(msg))
        if seen:
            out[name] = seen
    return out


def _run(stack: str, build: Callable[[Any], Any]) -> Recorder:
    raw = example_raw(stack)
    secret: frozenset[str] = frozenset()
    if stack.startswith("console"):
        raw["umbra:consoleDbPassword"] = "p" * 24
        secret = frozenset({"umbra:consoleDbPassword"})
    cfg = parse_stack_config(raw, secret)
    mocks, _ = run_program(lambda: build(cfg))
    return mocks


@pytest.fixture(scope="module")
def built() -> dict[str, Recorder]:
    def team(cfg: Any) -> Any:
        assert isinstance(cfg, TeamStack)
        return build_team(cfg, ROOT).security.instance_id

    return {"acme-gcp": _run("acme-gcp", team), "globex-azure": _run("globex-azure", team)}


def test_pack_constants_match_the_components() -> None:
    assert rules.SECURITY_TUNNEL_PORT == ports.SECURITY_TUNNEL_PORT
    assert ports.DEV_ATTESTED_SSH_PORT in rules.SSH_PORTS and 22 in rules.SSH_PORTS
    assert (rules.ROLE_LABEL, rules.ROLE_DEV, rules.ROLE_SECURITY) == (
        ports.ROLE_LABEL,
        ports.ROLE_DEV,
        ports.ROLE_SECURITY,
    )
    assert rules.SECURITY_ROUTE_TAG == ports.SECURITY_ROUTE_TAG
    from umbra.components.gcp_vm import MINIMAL_SCOPES

    assert list(rules.MINIMAL_SCOPES) == MINIMAL_SCOPES
    assert rules.ROLE_CONSOLE == ports.ROLE_CONSOLE
    assert set(POLICIES) == {
        "umbra-cvm-requires-tdx",
        "umbra-dev-cvm-no-bypass",
        "umbra-no-public-ssh",
    }


@pytest.mark.parametrize("stack", ["acme-gcp", "globex-azure"])
def test_everything_our_team_programs_build_passes(built: dict[str, Recorder], stack: str) -> None:
    mocks = built[stack]
    checked = {r.typ for r in mocks.resources} & {
        rules.GCP_INSTANCE,
        rules.GCP_FIREWALL,
        rules.GCP_ROUTE,
        rules.AZ_VM,
        rules.AZ_NIC,
        rules.AZ_NSG,
    }
    assert len(checked) >= 3  # the pack actually looked at CVMs and network rules
    for r in mocks.resources:
        assert violations(r.typ, dict(r.inputs), pack_config(stack)) == {}, (r.typ, r.name)


def _gcp(built: dict[str, Recorder], name: str) -> dict[str, Any]:
    res = next(
        r for r in built["acme-gcp"].resources if r.name == name and r.typ.startswith("gcp:")
    )
    return copy.deepcopy(dict(res.inputs))


def _az(built: dict[str, Recorder], name: str) -> dict[str, Any]:
    res = next(
        r
        for r in built["globex-azure"].resources
        if r.name == name and r.typ.startswith("azure-native:")
    )
    return copy.deepcopy(dict(res.inputs))


def test_non_tdx_cvms_are_refused(built: dict[str, Recorder]) -> None:
    vm = _gcp(built, "acme-alice-main")
    vm["confidentialInstanceConfig"] = {"confidentialInstanceType": "SEV_SNP"}
    assert "umbra-cvm-requires-tdx" in violations(rules.GCP_INSTANCE, vm)
    del vm["confidentialInstanceConfig"]
    assert violations(rules.GCP_INSTANCE, vm)["umbra-cvm-requires-tdx"] == [
        "confidentialInstanceConfig.confidentialInstanceType is None, not 'TDX'"
    ]
    az = _az(built, "globex-carol-main")
    az["securityProfile"]["securityType"] = "TrustedLaunch"
    assert violations(rules.AZ_VM, az)["umbra-cvm-requires-tdx"] == [
        "securityProfile.securityType is 'TrustedLaunch', not 'ConfidentialVM'"
    ]
    snp = _az(built, "globex-carol-main")
    snp["hardwareProfile"]["vmSize"] = "Standard_DC4as_v5"  # ConfidentialVM, but AMD SEV-SNP
    assert "not a TDX size" in violations(rules.AZ_VM, snp)["umbra-cvm-requires-tdx"][0]


def test_dev_cvm_routes_around_the_security_cvm_are_refused(built: dict[str, Recorder]) -> None:
    bypass = "umbra-dev-cvm-no-bypass"
    vm = _gcp(built, "acme-alice-main")
    vm["networkInterfaces"][0]["accessConfigs"] = [{}]
    assert violations(rules.GCP_INSTANCE, vm)[bypass] == [
        "networkInterfaces[0] has an external IP on a VM that is not the Console "
        "(umbra-role='dev-cvm')"
    ]

    fw = _gcp(built, "acme-dev-to-security")
    fw["destinationRanges"] = ["0.0.0.0/0"]
    assert bypass in violations(rules.GCP_FIREWALL, fw)
    fw = _gcp(built, "acme-dev-to-security")
    fw["allows"] = [{"protocol": "tcp", "ports": ["443"]}]
    assert bypass in violations(rules.GCP_FIREWALL, fw)
    # An untargeted egress allow applies to Dev CVMs too, whatever its description says.
    untargeted = _gcp(built, "acme-security-web-egress")
    del untargeted["targetServiceAccounts"]
    untargeted["description"] = "harmless"
    assert bypass in violations(rules.GCP_FIREWALL, untargeted)

    route = _gcp(built, "acme-security-egress-route")
    route["tags"] = []
    assert bypass in violations(rules.GCP_ROUTE, route)

    nic = _az(built, "globex-carol-main-nic")
    nic["ipConfigurations"][0]["publicIPAddress"] = {"id": "/subscriptions/x/publicIPAddresses/p"}
    assert violations(rules.AZ_NIC, nic)[bypass] == [
        "NIC ipConfigurations[0] has a public IP (role 'dev-cvm')"
    ]

    nsg = _az(built, "globex-dev-nsg")
    nsg["securityRules"].append(
        {
            "name": "web",
            "priority": 200,
            "direction": "Outbound",
            "access": "Allow",
            "protocol": "Tcp",
            "sourceAddressPrefix": "*",
            "destinationAddressPrefix": "Internet",
            "destinationPortRange": "443",
        }
    )
    found = violations(rules.AZ_NSG, nsg, pack_config("globex-azure"))[bypass]
    assert len(found) == 1 and "'web' allows outbound to ['Internet']" in found[0]


@pytest.mark.parametrize(
    ("resource_type", "props"),
    [
        (
            rules.GCP_FIREWALL,
            {
                "direction": "INGRESS",
                "sourceRanges": ["0.0.0.0/0"],
                "allows": [{"protocol": "tcp", "ports": ["22"]}],
            },
        ),
        (
            rules.GCP_FIREWALL,
            {"sourceRanges": ["0.0.0.0/0"], "allows": [{"protocol": "tcp", "ports": ["20-30"]}]},
        ),
        (
            rules.GCP_FIREWALL,
            {"direction": "INGRESS", "sourceRanges": ["::/0"], "allows": [{"protocol": "all"}]},
        ),
        (
            rules.GCP_FIREWALL,
            {
                "direction": "INGRESS",
                "sourceRanges": ["0.0.0.0/0"],
                "allows": [{"protocol": "tcp", "ports": ["8022"]}],
            },
        ),
        (
            rules.AZ_RULE,
            {
                "direction": "Inbound",
                "access": "Allow",
                "protocol": "Tcp",
                "sourceAddressPrefix": "*",
                "destinationPortRange": "22",
            },
        ),
        (
            rules.AZ_RULE,
            {
                "direction": "Inbound",
                "access": "Allow",
                "protocol": "*",
                "sourceAddressPrefix": "Internet",
                "destinationPortRanges": ["80", "1-1024"],
            },
        ),
        (
            rules.AZ_NSG,
            {
                "securityRules": [
                    {
                        "name": "ssh",
                        "priority": 100,
                        "direction": "Inbound",
                        "access": "Allow",
                        "protocol": "Tcp",
                        "sourceAddressPrefixes": ["0.0.0.0/0"],
                        "destinationPortRange": "*",
                    }
                ]
            },
        ),
    ],
)
def test_public_ssh_is_refused(resource_type: str, props: dict[str, Any]) -> None:
    assert "umbra-no-public-ssh" in violations(resource_type, props)


@pytest.mark.parametrize(
    ("resource_type", "props"),
    [
        (
            rules.GCP_FIREWALL,
            {
                "direction": "INGRESS",
                "sourceRanges": ["35.235.240.0/20"],
                "allows": [{"protocol": "tcp", "ports": ["22"]}],
            },
        ),
        (
            rules.GCP_FIREWALL,
            {
                "direction": "INGRESS",
                "sourceRanges": ["0.0.0.0/0"],
                "allows": [{"protocol": "tcp", "ports": ["443"]}],
            },
        ),
        (
            rules.GCP_FIREWALL,
            {
                "direction": "EGRESS",
                "destinationRanges": ["0.0.0.0/0"],
                "targetServiceAccounts": ["umbra-a-sec@p.iam.gserviceaccount.com"],
                "allows": [{"protocol": "tcp", "ports": ["22"]}],
            },
        ),
        (
            rules.AZ_RULE,
            {
                "direction": "Inbound",
                "access": "Deny",
                "protocol": "*",
                "sourceAddressPrefix": "*",
                "destinationPortRange": "*",
            },
        ),
    ],
)
def test_non_public_or_non_ssh_rules_pass(resource_type: str, props: dict[str, Any]) -> None:
    assert violations(resource_type, props) == {}


# --- gaps closed: what a reviewer found the pack let through ------------------------------------

BYPASS = "umbra-dev-cvm-no-bypass"
TDX = "umbra-cvm-requires-tdx"


def test_an_external_ip_without_umbra_labels_is_refused(built: dict[str, Recorder]) -> None:
    vm = _gcp(built, "acme-alice-main")
    del vm["labels"]
    vm["networkInterfaces"][0]["accessConfigs"] = [{}]
    assert "has an external IP" in violations(rules.GCP_INSTANCE, vm)[BYPASS][0]
    sec = copy.deepcopy(dict(built["acme-gcp"].one(rules.GCP_INSTANCE, "acme-security").inputs))
    sec["networkInterfaces"][0]["accessConfigs"] = [{}]  # the Security CVM egresses via NAT
    assert BYPASS in violations(rules.GCP_INSTANCE, sec)
    console = _gcp(built, "acme-alice-main")
    console["labels"] = {"umbra-role": "console"}
    console["networkInterfaces"][0]["accessConfigs"] = [{}]
    assert BYPASS not in violations(rules.GCP_INSTANCE, console)


def test_untagged_or_public_nics_are_refused(built: dict[str, Recorder]) -> None:
    nic = _az(built, "globex-carol-main-nic")
    del nic["tags"]
    assert violations(rules.AZ_NIC, nic)[BYPASS] == [
        "NIC has no umbra-role tag: the pack cannot tell what it carries"
    ]
    sec = _az(built, "globex-security-nic")
    sec["ipConfigurations"][0]["publicIPAddress"] = {"id": "pip"}
    assert "has a public IP" in violations(rules.AZ_NIC, sec)[BYPASS][0]


def test_standalone_allow_security_rules_are_refused() -> None:
    allow = {
        "direction": "Outbound",
        "access": "Allow",
        "protocol": "*",
        "sourceAddressPrefix": "*",
        "destinationAddressPrefix": "Internet",
        "destinationPortRange": "*",
        "networkSecurityGroupName": "umbra-globex-dev",
    }
    assert "standalone allow SecurityRule" in violations(rules.AZ_RULE, allow)[BYPASS][0]
    assert BYPASS not in violations(rules.AZ_RULE, allow | {"access": "Deny"})


@pytest.mark.parametrize(
    "resource_type",
    [
        rules.GCP_INSTANCE_TEMPLATE,
        rules.GCP_REGION_TEMPLATE,
        rules.GCP_FROM_TEMPLATE,
        rules.GCP_FROM_MACHINE_IMAGE,
    ],
)
def test_templates_and_instances_from_templates_are_checked(
    built: dict[str, Recorder], resource_type: str
) -> None:
    ok = _gcp(built, "acme-alice-main")
    assert violations(resource_type, ok) == {}
    # An instance from a template that does not restate TDX inherits whatever the template says.
    bare = {"sourceInstanceTemplate": "t", "zone": "us-central1-a", "labels": ok["labels"]}
    assert len(violations(resource_type, bare)[TDX]) == 3
    public = ok | {"networkInterfaces": [{"subnetwork": "s", "accessConfigs": [{}]}]}
    assert BYPASS in violations(resource_type, public)


def test_azure_scale_sets_are_checked(built: dict[str, Recorder]) -> None:
    vm = _az(built, "globex-carol-main")
    vmss = {
        "sku": {"name": vm["hardwareProfile"]["vmSize"], "capacity": 1},
        "tags": vm["tags"],
        "virtualMachineProfile": {
            "securityProfile": vm["securityProfile"],
            "storageProfile": vm["storageProfile"],
            "networkProfile": {"networkInterfaceConfigurations": []},
        },
    }
    assert violations(rules.AZ_VMSS, vmss) == {}
    plain = copy.deepcopy(vmss)
    plain["sku"]["name"] = "Standard_D4s_v5"
    plain["virtualMachineProfile"]["securityProfile"] = {"securityType": "TrustedLaunch"}
    assert len(violations(rules.AZ_VMSS, plain)[TDX]) == 3
    public = copy.deepcopy(vmss)
    public["virtualMachineProfile"]["networkProfile"]["networkInterfaceConfigurations"] = [
        {"ipConfigurations": [{"publicIPAddressConfiguration": {"name": "pip"}}]}
    ]
    assert BYPASS in violations(rules.AZ_VMSS, public)


@pytest.mark.parametrize(
    ("props", "refused"),
    [
        ({"destRange": "0.0.0.0/1", "nextHopIp": "10.20.0.9"}, True),
        ({"destRange": "128.0.0.0/1", "nextHopInstance": "rogue"}, True),
        ({"destRange": "0.0.0.0/0", "nextHopIlb": "fr"}, True),
        ({"destRange": "10.50.0.0/16", "nextHopIp": "10.20.0.9"}, False),
        (
            {
                "destRange": "128.0.0.0/1",
                "nextHopGateway": "default-internet-gateway",
                "tags": ["umbra-dev-cvm"],
            },
            True,
        ),
    ],
)
def test_routes_around_the_security_cvm_are_refused(props: dict[str, Any], refused: bool) -> None:
    assert (BYPASS in violations(rules.GCP_ROUTE, props)) is refused


def test_azure_routes_to_the_internet_are_refused() -> None:
    table = {
        "routes": [
            {"addressPrefix": "0.0.0.0/1", "nextHopType": "VirtualAppliance"},
            {"addressPrefix": "10.0.0.0/8", "nextHopType": "VnetLocal"},
        ]
    }
    assert len(violations(rules.AZ_ROUTE_TABLE, table)[BYPASS]) == 1
    assert BYPASS in violations(
        rules.AZ_ROUTE, {"addressPrefix": "128.0.0.0/1", "nextHopType": "Internet"}
    )


def test_split_default_egress_rules_for_dev_cvms_are_refused(built: dict[str, Recorder]) -> None:
    fw = _gcp(built, "acme-dev-to-security")
    fw["destinationRanges"] = ["0.0.0.0/1", "128.0.0.0/1"]
    assert BYPASS in violations(rules.GCP_FIREWALL, fw)


@pytest.mark.parametrize("machine", ["n2d-standard-4", "c3-highcpu-4", "c3d-standard-4", None])
def test_non_tdx_machine_types_are_refused(built: dict[str, Recorder], machine: str | None) -> None:
    vm = _gcp(built, "acme-alice-main")
    vm["machineType"] = machine
    assert "is not a TDX machine type" in violations(rules.GCP_INSTANCE, vm)[TDX][0]
    vm["machineType"] = "zones/us-central1-a/machineTypes/c3-standard-8"
    assert violations(rules.GCP_INSTANCE, vm) == {}


def test_api_scopes_on_a_team_cvm_are_refused(built: dict[str, Recorder]) -> None:
    vm = _gcp(built, "acme-alice-main")
    vm["serviceAccount"]["scopes"] = ["https://www.googleapis.com/auth/cloud-platform"]
    assert "a team CVM calls no Google API" in violations(rules.GCP_INSTANCE, vm)[BYPASS][0]
    vm["labels"]["umbra-role"] = "console"
    assert BYPASS not in violations(rules.GCP_INSTANCE, vm)


# --- Dev CVM -> Console on tcp 443: only to the addresses declared to the pack ---------------------

CONSOLE = "198.51.100.7"
DECLARED = {BYPASS: {"console_ips": [CONSOLE]}}


def test_the_packs_console_config_is_the_stacks_console_ips() -> None:
    for stack in ("acme-gcp", "globex-azure"):
        cfg = parse_stack_config(example_raw(stack), frozenset())
        assert isinstance(cfg, TeamStack)
        assert pack_config(stack)[BYPASS]["console_ips"] == [str(ip) for ip in cfg.console_ips]
    assert rules.CONSOLE_PORT == ports.CONSOLE_PORT
    schema = POLICIES[BYPASS].config_schema
    assert schema is not None and set(schema.properties) == {"console_ips"}


@pytest.mark.parametrize(
    ("stack", "typ", "name"),
    [
        ("acme-gcp", rules.GCP_FIREWALL, "acme-dev-console-egress"),
        ("acme-gcp", rules.GCP_ROUTE, "acme-dev-console-route-0"),
        ("globex-azure", rules.AZ_NSG, "globex-dev-nsg"),
        ("globex-azure", rules.AZ_ROUTE_TABLE, "globex-dev-routes"),
    ],
)
def test_the_console_path_passes_only_when_declared_to_the_pack(
    built: dict[str, Recorder], stack: str, typ: str, name: str
) -> None:
    props = copy.deepcopy(dict(built[stack].one(typ, name).inputs))
    assert violations(typ, props, DECLARED) == {}
    undeclared = violations(typ, props)[BYPASS]
    assert len(undeclared) == 1 and "(none declared)" in undeclared[0]
    other = violations(typ, props, {BYPASS: {"console_ips": ["203.0.113.9"]}})
    assert BYPASS in other


def _console_fw(built: dict[str, Recorder]) -> dict[str, Any]:
    return _gcp(built, "acme-dev-console-egress")


@pytest.mark.parametrize(
    "change",
    [
        {"destinationRanges": ["0.0.0.0/0"]},
        {"destinationRanges": ["198.51.100.0/24"]},  # the Console's whole range
        {"destinationRanges": ["198.51.100.7/32", "198.51.100.8/32"]},  # one undeclared
        {"destinationRanges": ["198.51.100.7/32", "10.20.1.10/32"]},  # mixed with the tunnel
        {"destinationRanges": []},
        {"allows": [{"protocol": "tcp", "ports": ["80"]}]},
        {"allows": [{"protocol": "tcp", "ports": ["443", "8443"]}]},
        {"allows": [{"protocol": "tcp", "ports": ["443-444"]}]},
        {"allows": [{"protocol": "tcp"}]},  # every port
        {"allows": [{"protocol": "udp", "ports": ["443"]}]},
        {"allows": [{"protocol": "all"}]},
        {"allows": [{"protocol": "tcp", "ports": ["443"]}, {"protocol": "udp", "ports": ["443"]}]},
        {"allows": [{"protocol": "tcp", "ports": ["8443"]}]},  # tunnel port to the Console
    ],
)
def test_widened_gcp_console_rules_are_refused(
    built: dict[str, Recorder], change: dict[str, Any]
) -> None:
    fw = _console_fw(built) | change
    assert BYPASS in violations(rules.GCP_FIREWALL, fw, DECLARED), change


@pytest.mark.parametrize(
    "route",
    [
        {"destRange": "0.0.0.0/0"},
        {"destRange": "198.51.100.0/24"},
        {"destRange": "198.51.100.8/32"},
        {"destRange": "128.0.0.0/1"},
    ],
)
def test_gcp_internet_routes_beyond_the_console_are_refused(
    built: dict[str, Recorder], route: dict[str, Any]
) -> None:
    props = _gcp(built, "acme-dev-console-route-0") | route
    assert BYPASS in violations(rules.GCP_ROUTE, props, DECLARED)


def _az_console_rule(built: dict[str, Recorder]) -> tuple[dict[str, Any], dict[str, Any]]:
    nsg = _az(built, "globex-dev-nsg")
    rule = next(r for r in nsg["securityRules"] if r["name"] == "to-console")
    return nsg, rule


@pytest.mark.parametrize(
    "change",
    [
        {"destinationAddressPrefix": "Internet"},
        {"destinationAddressPrefix": "*"},
        {"destinationAddressPrefix": "0.0.0.0/0"},
        {"destinationAddressPrefix": "198.51.100.0/24"},
        {"destinationAddressPrefix": "198.51.100.8/32"},
        {"destinationPortRanges": ["*"]},
        {"destinationPortRanges": ["443-444"]},
        {"destinationPortRanges": ["443", "8443"]},
        {"destinationPortRanges": ["80"]},
        {"protocol": "Udp"},
        {"protocol": "*"},
    ],
)
def test_widened_azure_console_rules_are_refused(
    built: dict[str, Recorder], change: dict[str, Any]
) -> None:
    nsg, rule = _az_console_rule(built)
    if any(k.startswith("destinationAddress") for k in change):
        rule.pop("destinationAddressPrefixes", None)
        rule.pop("destinationAddressPrefix", None)
    rule.update(change)
    found = violations(rules.AZ_NSG, nsg, DECLARED)[BYPASS]
    assert any("'to-console'" in m for m in found), change


def test_azure_internet_routes_beyond_the_console_are_refused(built: dict[str, Recorder]) -> None:
    table = _az(built, "globex-dev-routes")
    assert violations(rules.AZ_ROUTE_TABLE, table, DECLARED) == {}
    for prefix in ("198.51.100.8/32", "198.51.100.0/24", "0.0.0.0/0"):
        widened = copy.deepcopy(table)
        widened["routes"].append({"addressPrefix": prefix, "nextHopType": "Internet"})
        assert BYPASS in violations(rules.AZ_ROUTE_TABLE, widened, DECLARED), prefix
    via_appliance = {"addressPrefix": f"{CONSOLE}/32", "nextHopType": "VirtualAppliance"}
    assert BYPASS in violations(rules.AZ_ROUTE, via_appliance, DECLARED)


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("0.0.0.0/0", "is a range"),
        ("198.51.100.0/24", "is a range"),
        ("0.0.0.0", "cannot be a Console"),  # noqa: S104
        ("169.254.169.254", "cannot be a Console"),
        ("console.example", "is not an IPv4 host"),
    ],
)
def test_a_wide_or_bogus_pack_config_declares_nothing(
    built: dict[str, Recorder], entry: str, why: str
) -> None:
    fw = _console_fw(built) | {"destinationRanges": [entry]}
    found = violations(rules.GCP_FIREWALL, fw, {BYPASS: {"console_ips": [entry]}})[BYPASS]
    assert why in found[0] and "(none declared)" in found[0]
    ok = violations(rules.GCP_FIREWALL, _console_fw(built), {BYPASS: {"console_ips": [entry]}})
    assert BYPASS in ok  # the real Console address is not declared either
