"""The Azure team program (stacks/Pulumi.globex-azure.yaml) under mocks: confidential VM settings,
custom data, NICs and the NSG topology evaluated flow by flow."""

from __future__ import annotations

import base64
import json

import pytest

from tests.infra.harness import ROOT, Recorder, azure_allows, example_raw, run_program
from umbra.attest.measurement import SSH_KEYS_EVENT
from umbra.components.config import TeamStack, parse_stack_config
from umbra.components.ports import PRIVATE_ZONE, SECURITY_CVM_HOST
from umbra.components.program import build_team

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

VM = "azure-native:compute:VirtualMachine"
NIC = "azure-native:network:NetworkInterface"
NSG = "azure-native:network:NetworkSecurityGroup"
SECURITY_IP = "10.30.1.10"


@pytest.fixture(scope="module")
def globex() -> Recorder:
    cfg = parse_stack_config(example_raw("globex-azure"), frozenset())
    assert isinstance(cfg, TeamStack)
    mocks, _ = run_program(lambda: build_team(cfg, ROOT).security.instance_id)
    return mocks


def test_every_vm_is_a_tdx_confidential_vm(globex: Recorder) -> None:
    vms = globex.of_type(VM)
    assert sorted(v.name for v in vms) == ["globex-carol-main", "globex-security"]
    for vm in vms:
        p = vm.inputs
        assert p["securityProfile"] == {
            "securityType": "ConfidentialVM",
            "uefiSettings": {"secureBootEnabled": True, "vTpmEnabled": True},
        }
        assert p["hardwareProfile"]["vmSize"] in ("Standard_DC4es_v5", "Standard_EC8es_v5")
        disk = p["storageProfile"]["osDisk"]["managedDisk"]
        assert disk["securityProfile"] == {"securityEncryptionType": "DiskWithVMGuestState"}
        linux = p["osProfile"]["linuxConfiguration"]
        assert linux["disablePasswordAuthentication"] is True
        assert linux["provisionVMAgent"] is False


def test_user_data_carries_the_launch_data_and_custom_data_none(globex: Recorder) -> None:
    """Fails before the fix: the launch data went to customData, which IMDS answers empty, while
    the launch agent reads IMDS userData."""
    vm = globex.one(VM, "globex-carol-main")
    assert "customData" not in vm.inputs["osProfile"]
    data = json.loads(base64.b64decode(vm.inputs["userData"]))["umbra"]
    assert data["umbra-role"] == "dev-cvm"
    assert data["umbra-ssh-authorized-keys"].startswith("ssh-ed25519 ")
    assert SSH_KEYS_EVENT in json.loads(data["umbra-rtmr3-events"])


def test_no_nic_has_a_public_ip_and_the_security_cvm_has_a_fixed_address(
    globex: Recorder,
) -> None:
    sec = globex.one(NIC, "globex-security-nic").inputs["ipConfigurations"][0]
    dev = globex.one(NIC, "globex-carol-main-nic").inputs["ipConfigurations"][0]
    assert sec["privateIPAddress"] == SECURITY_IP
    assert sec["privateIPAllocationMethod"] == "Static"
    # The Security CVM egresses through the NAT Gateway: no NIC has a public address.
    assert "publicIPAddress" not in sec
    assert "publicIPAddress" not in dev
    for subnet in globex.of_type("azure-native:network:Subnet"):
        assert subnet.inputs["defaultOutboundAccess"] is False


@pytest.mark.parametrize(
    ("dst", "port", "allowed"),
    [
        (SECURITY_IP, 8443, True),
        (SECURITY_IP, 22, False),
        ("10.30.1.11", 8443, False),
        ("10.30.0.20", 8022, False),  # another Dev CVM
        ("8.8.8.8", 443, False),
        ("8.8.8.8", 53, False),
    ],
)
def test_dev_nsg_egress_only_to_security_tunnel(
    globex: Recorder, dst: str, port: int, allowed: bool
) -> None:
    nsg = globex.one(NSG, "globex-dev-nsg")
    assert azure_allows(nsg, direction="Outbound", src="10.30.0.5", dst=dst, port=port) is allowed


def test_ingress_and_security_nsg_flows(globex: Recorder) -> None:
    dev = globex.one(NSG, "globex-dev-nsg")
    sec = globex.one(NSG, "globex-security-nsg")
    assert azure_allows(dev, direction="Inbound", src="198.51.100.7", dst="10.30.0.5", port=8022)
    assert not azure_allows(dev, direction="Inbound", src="198.51.100.7", dst="10.30.0.5", port=22)
    assert not azure_allows(dev, direction="Inbound", src="203.0.113.1", dst="10.30.0.5", port=8022)
    assert not azure_allows(dev, direction="Inbound", src=SECURITY_IP, dst="10.30.0.5", port=8022)
    assert azure_allows(sec, direction="Inbound", src="10.30.0.5", dst=SECURITY_IP, port=8443)
    assert not azure_allows(sec, direction="Inbound", src="203.0.113.1", dst=SECURITY_IP, port=8443)
    assert azure_allows(sec, direction="Outbound", src=SECURITY_IP, dst="93.184.215.14", port=443)
    assert not azure_allows(
        sec, direction="Outbound", src=SECURITY_IP, dst="93.184.215.14", port=22
    )
    assert not azure_allows(sec, direction="Outbound", src=SECURITY_IP, dst="10.30.0.5", port=443)


def test_the_security_cvm_name_resolves_privately_to_its_fixed_address(globex: Recorder) -> None:
    (vnet,) = globex.of_type("azure-native:network:VirtualNetwork")
    (zone,) = globex.of_type("azure-native:privatedns:PrivateZone")
    assert zone.inputs["privateZoneName"] == PRIVATE_ZONE
    (link,) = globex.of_type("azure-native:privatedns:VirtualNetworkLink")
    assert link.inputs["virtualNetwork"] == {"id": f"{vnet.name}-id"}, "linked to this team only"
    assert link.inputs["registrationEnabled"] is False
    (record,) = globex.of_type("azure-native:privatedns:PrivateRecordSet")
    assert record.inputs["recordType"] == "A"
    assert f"{record.inputs['relativeRecordSetName']}.{PRIVATE_ZONE}" == SECURITY_CVM_HOST
    assert record.inputs["aRecords"] == [{"ipv4Address": SECURITY_IP}]
