"""Rules of the Umbra policy pack, as plain functions of (resource type, props) -> violations.

Props are the engine's camelCase input properties. The pack runs in its own interpreter, so it
imports nothing from umbra; the constants below must equal umbra.components.ports (a test
checks). A value that is unknown at preview is treated as not compliant where it matters.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

ROLE_LABEL = "umbra-role"
ROLE_DEV = "dev-cvm"
ROLE_SECURITY = "security-cvm"
SECURITY_ROUTE_TAG = "umbra-security-cvm"
SECURITY_TUNNEL_PORT = 8443
# Port 22 and the Dev CVM's attested SSH port: neither may face the whole internet.
SSH_PORTS = (22, 8022)

ROLE_CONSOLE = "console"
MINIMAL_SCOPES = ("https://www.googleapis.com/auth/userinfo.email",)
GCP_INSTANCE = "gcp:compute/instance:Instance"
GCP_INSTANCE_TEMPLATE = "gcp:compute/instanceTemplate:InstanceTemplate"
GCP_REGION_TEMPLATE = "gcp:compute/regionInstanceTemplate:RegionInstanceTemplate"
GCP_FROM_TEMPLATE = "gcp:compute/instanceFromTemplate:InstanceFromTemplate"
GCP_FROM_MACHINE_IMAGE = "gcp:compute/instanceFromMachineImage:InstanceFromMachineImage"
GCP_VMS = (
    GCP_INSTANCE,
    GCP_INSTANCE_TEMPLATE,
    GCP_REGION_TEMPLATE,
    GCP_FROM_TEMPLATE,
    GCP_FROM_MACHINE_IMAGE,
)
GCP_FIREWALL = "gcp:compute/firewall:Firewall"
GCP_ROUTE = "gcp:compute/route:Route"
AZ_VM = "azure-native:compute:VirtualMachine"
AZ_VMSS = "azure-native:compute:VirtualMachineScaleSet"
AZ_ROUTE = "azure-native:network:Route"
AZ_ROUTE_TABLE = "azure-native:network:RouteTable"
AZ_NIC = "azure-native:network:NetworkInterface"
AZ_NSG = "azure-native:network:NetworkSecurityGroup"
AZ_RULE = "azure-native:network:SecurityRule"

AZURE_TDX_SIZE = re.compile(r"^Standard_[DE]C\d+(ed|e)s_v5$|^Standard_[DE]C\d+es_v6$")
# GCP machine types that run TDX: C3 standard. Self links end with the type.
GCP_TDX_MACHINE = re.compile(r"(^|/)c3-standard-\d+$")
# Sources that mean "anyone" (Azure service tags are case-insensitive). Not a bind address.
WORLD = frozenset({"*", "0.0.0.0/0", "::/0", "internet", "any", "0.0.0.0"})  # noqa: S104
DEV_SA = re.compile(r"^umbra-[a-z0-9-]+-dev@")

Props = Mapping[str, Any]
Rule = Callable[[str, Props], list[str]]


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def _role(props: Props, labels_key: str) -> str | None:
    role = _get(props, labels_key, ROLE_LABEL)
    return role if isinstance(role, str) else None


# --- TDX ---------------------------------------------------------------------------------------


def _azure_tdx(out: list[str], sec_profile: Any, size: Any, os_disk: Any, where: str) -> None:
    sec = _get(sec_profile, "securityType")
    if sec != "ConfidentialVM":
        out.append(f"{where}securityProfile.securityType is {sec!r}, not 'ConfidentialVM'")
    if not isinstance(size, str) or not AZURE_TDX_SIZE.match(size):
        out.append(f"{where}size {size!r} is not a TDX size (DCesv5/ECesv5/DCesv6)")
    uefi = _get(sec_profile, "uefiSettings") or {}
    if uefi.get("secureBootEnabled") is not True or uefi.get("vTpmEnabled") is not True:
        out.append(f"{where}securityProfile.uefiSettings must enable secure boot and the vTPM")
    enc = _get(os_disk, "managedDisk", "securityProfile", "securityEncryptionType")
    if enc != "DiskWithVMGuestState":
        out.append(f"{where}OS disk securityEncryptionType is {enc!r}, not 'DiskWithVMGuestState'")


def check_tdx(resource_type: str, props: Props) -> list[str]:
    if resource_type in GCP_VMS:
        # Instances made from templates or machine images inherit what they do not say: the
        # pack cannot see the template, so the TDX settings must be stated on the resource.
        out = []
        kind = _get(props, "confidentialInstanceConfig", "confidentialInstanceType")
        if kind != "TDX":
            out.append(
                f"confidentialInstanceConfig.confidentialInstanceType is {kind!r}, not 'TDX'"
            )
        maint = _get(props, "scheduling", "onHostMaintenance")
        if maint != "TERMINATE":
            out.append(f"scheduling.onHostMaintenance is {maint!r}; a TDX VM needs 'TERMINATE'")
        machine = props.get("machineType")
        if not isinstance(machine, str) or not GCP_TDX_MACHINE.search(machine):
            out.append(f"machineType {machine!r} is not a TDX machine type (c3-standard-N)")
        return out
    if resource_type == AZ_VM:
        out = []
        _azure_tdx(
            out,
            props.get("securityProfile"),
            _get(props, "hardwareProfile", "vmSize"),
            _get(props, "storageProfile", "osDisk"),
            "",
        )
        return [m.replace("size ", "hardwareProfile.vmSize ", 1) for m in out]
    if resource_type == AZ_VMSS:
        out = []
        profile = props.get("virtualMachineProfile")
        _azure_tdx(
            out,
            _get(profile, "securityProfile"),
            _get(props, "sku", "name"),
            _get(profile, "storageProfile", "osDisk"),
            "virtualMachineProfile.",
        )
        return out
    return []


# --- Dev CVM has no way out but the Security CVM ------------------------------------------------


def _single_private_hosts(ranges: Iterable[Any]) -> bool:
    seen = False
    for r in ranges:
        seen = True
        try:
            net = ipaddress.ip_network(str(r), strict=True)
        except ValueError:
            return False  # service tags ("Internet", "*"), unknowns, names
        if net.num_addresses != 1 or not net.is_private:
            return False
    return seen


def _gcp_firewall_targets_dev(props: Props) -> bool:
    if str(props.get("description") or "").startswith(f"{ROLE_LABEL}={ROLE_DEV}"):
        return True
    sas = _list(props.get("targetServiceAccounts"))
    tags = _list(props.get("targetTags"))
    if not sas and not tags:
        return True  # no target: applies to every instance in the network
    return any(isinstance(s, str) and DEV_SA.match(s) for s in sas) or ROLE_DEV in tags


def _gcp_ports_only_tunnel(allows: list[Any]) -> bool:
    for allow in allows:
        if _get(allow, "protocol") != "tcp":
            return False
        if _list(_get(allow, "ports")) != [str(SECURITY_TUNNEL_PORT)]:
            return False
    return True


def _gcp_external(props: Props) -> list[int]:
    return [
        i
        for i, ni in enumerate(_list(props.get("networkInterfaces")))
        if _list(_get(ni, "accessConfigs")) or _list(_get(ni, "ipv6AccessConfigs"))
    ]


def _non_private(ranges: Iterable[Any]) -> list[str]:
    """Destinations that are not inside a private range (0.0.0.0/1 + 128.0.0.0/1 included)."""
    out = []
    for r in ranges:
        try:
            net = ipaddress.ip_network(str(r), strict=False)
        except ValueError:
            out.append(str(r))  # service tags, unknowns: assume the worst
            continue
        if not net.is_private:
            out.append(str(r))
    return out


def check_dev_isolation(resource_type: str, props: Props) -> list[str]:
    out: list[str] = []
    if resource_type in GCP_VMS:
        # Only the Console serves the internet. Every other VM, labelled or not, has no external
        # address: the Security CVM egresses through Cloud NAT.
        if _role(props, "labels") != ROLE_CONSOLE:
            for i in _gcp_external(props):
                out.append(
                    f"networkInterfaces[{i}] has an external IP on a VM that is not the Console "
                    f"({ROLE_LABEL}={_role(props, 'labels')!r})"
                )
        if props.get("canIpForward"):
            out.append(f"canIpForward is enabled ({ROLE_LABEL}={_role(props, 'labels')!r})")
        if _role(props, "labels") != ROLE_CONSOLE:
            scopes = _list(_get(props, "serviceAccount", "scopes"))
            broad = [x for x in scopes if x not in MINIMAL_SCOPES and x != "userinfo-email"]
            if broad:
                out.append(
                    f"service account scopes {broad}: a team CVM calls no Google API "
                    "(only the Console's VM may hold API scopes)"
                )
    elif resource_type == GCP_ROUTE:
        hop_gateway = props.get("nextHopGateway")
        dests = [props.get("destRange")]
        if isinstance(hop_gateway, str) and hop_gateway.endswith("default-internet-gateway"):
            tags = _list(props.get("tags"))
            if tags != [SECURITY_ROUTE_TAG]:
                out.append(
                    f"internet route with tags {tags or 'none (all instances)'}: only the "
                    f"Security CVM ({SECURITY_ROUTE_TAG}) may have one"
                )
        for hop in ("nextHopIp", "nextHopInstance", "nextHopIlb", "nextHopVpnTunnel"):
            if props.get(hop) and _non_private(dests):
                out.append(
                    f"route to {dests[0]} via {hop}: a public destination through another "
                    "machine would let a Dev CVM around its Security CVM"
                )
    elif resource_type in (AZ_ROUTE, AZ_ROUTE_TABLE):
        routes = [props] if resource_type == AZ_ROUTE else _list(props.get("routes"))
        for route in routes:
            hop = _get(route, "nextHopType")
            dest = _get(route, "addressPrefix")
            if hop in ("Internet", "VirtualAppliance", "VirtualNetworkGateway") and _non_private(
                [dest]
            ):
                out.append(f"route to {dest} via {hop}: only the Security CVM reaches the internet")
    elif resource_type == AZ_NIC:
        role = _role(props, "tags")
        if role is None:
            out.append(f"NIC has no {ROLE_LABEL} tag: the pack cannot tell what it carries")
        if role != ROLE_CONSOLE:
            for i, cfg in enumerate(_list(props.get("ipConfigurations"))):
                if _get(cfg, "publicIPAddress"):
                    out.append(f"NIC ipConfigurations[{i}] has a public IP (role {role!r})")
        if props.get("enableIPForwarding"):
            out.append(f"NIC has IP forwarding enabled (role {role!r})")
    elif resource_type in (AZ_VM, AZ_VMSS):
        base = props if resource_type == AZ_VM else props.get("virtualMachineProfile")
        if _role(props, "tags") != ROLE_CONSOLE:
            for nic in _list(_get(base, "networkProfile", "networkInterfaceConfigurations")):
                for cfg in _list(_get(nic, "ipConfigurations")):
                    if _get(cfg, "publicIPAddressConfiguration"):
                        out.append("network interface configuration has a public IP")
    elif resource_type == AZ_RULE and props.get("access") != "Deny":
        # A standalone allow joins an NSG the pack cannot see (a deny only narrows): allow
        # rules live inline in their NSG, where the whole set is checked.
        out.append(
            "standalone allow SecurityRule: declare it inline in its NetworkSecurityGroup so the "
            "whole rule set is checked"
        )
    elif resource_type == GCP_FIREWALL:
        egress_allow = props.get("direction") == "EGRESS" and _list(props.get("allows"))
        if egress_allow and _gcp_firewall_targets_dev(props):
            dests = _list(props.get("destinationRanges"))
            if not _single_private_hosts(dests) or not _gcp_ports_only_tunnel(
                _list(props.get("allows"))
            ):
                out.append(
                    f"egress rule for Dev CVMs allows {dests or 'every destination'}: "
                    f"only the Security CVM's address on tcp:{SECURITY_TUNNEL_PORT} is allowed"
                )
    elif resource_type == AZ_NSG and _role(props, "tags") == ROLE_DEV:
        for rule in _list(props.get("securityRules")):
            if _get(rule, "direction") == "Outbound" and _get(rule, "access") == "Allow":
                dests = _azure_prefixes(rule, "destination")
                ports = _azure_ports(rule)
                if not _single_private_hosts(dests) or ports != [(SECURITY_TUNNEL_PORT,) * 2]:
                    out.append(
                        f"Dev CVM NSG rule {_get(rule, 'name')!r} allows outbound to {dests} "
                        f"ports {ports}: only the Security CVM on {SECURITY_TUNNEL_PORT} is allowed"
                    )
    return out


# --- No public SSH -------------------------------------------------------------------------------


def _port_ranges(specs: Iterable[Any]) -> list[tuple[int, int]] | None:
    """None means every port."""
    out = []
    for spec in specs:
        s = str(spec).strip()
        if s in ("*", "0-65535"):
            return None
        lo, _, hi = s.partition("-")
        try:
            out.append((int(lo), int(hi or lo)))
        except ValueError:
            return None  # unknown at preview: assume the worst
    return out


def _covers_ssh(ranges: list[tuple[int, int]] | None) -> bool:
    return ranges is None or any(lo <= p <= hi for lo, hi in ranges for p in SSH_PORTS)


def _azure_prefixes(rule: Any, side: str) -> list[str]:
    one = _get(rule, f"{side}AddressPrefix")
    many = _list(_get(rule, f"{side}AddressPrefixes"))
    return [str(p) for p in ([one] if one else []) + many]


def _azure_ports(rule: Any) -> list[tuple[int, int]] | None:
    one = _get(rule, "destinationPortRange")
    many = _list(_get(rule, "destinationPortRanges"))
    specs = ([one] if one else []) + many
    return _port_ranges(specs) if specs else None


def _azure_rule_public_ssh(rule: Any) -> bool:
    if _get(rule, "direction") != "Inbound" or _get(rule, "access") != "Allow":
        return False
    if str(_get(rule, "protocol")).lower() not in ("tcp", "*"):
        return False
    sources = {p.lower() for p in _azure_prefixes(rule, "source")}
    return bool(sources & WORLD) and _covers_ssh(_azure_ports(rule))


def check_public_ssh(resource_type: str, props: Props) -> list[str]:
    if resource_type == GCP_FIREWALL:
        if props.get("direction", "INGRESS") != "INGRESS":
            return []
        sources = {str(s) for s in _list(props.get("sourceRanges"))}
        if not sources & {"0.0.0.0/0", "::/0"}:
            return []
        for allow in _list(props.get("allows")):
            proto = _get(allow, "protocol")
            ports = _list(_get(allow, "ports"))
            if proto in ("tcp", "all") and _covers_ssh(_port_ranges(ports) if ports else None):
                return [f"firewall opens SSH ports {list(SSH_PORTS)} to {sorted(sources)}"]
        return []
    if resource_type == AZ_NSG:
        return [
            f"NSG rule {_get(r, 'name')!r} opens SSH ports {list(SSH_PORTS)} to the internet"
            for r in _list(props.get("securityRules"))
            if _azure_rule_public_ssh(r)
        ]
    if resource_type == AZ_RULE and _azure_rule_public_ssh(props):
        return [f"security rule opens SSH ports {list(SSH_PORTS)} to the internet"]
    return []


RULES: dict[str, tuple[str, Rule]] = {
    "umbra-cvm-requires-tdx": (
        "Every VM, template and scale set is an Intel TDX confidential VM on a TDX machine type.",
        check_tdx,
    ),
    "umbra-dev-cvm-no-bypass": (
        "No VM but the Console has an external IP; no route or rule lets a Dev CVM around its "
        "Security CVM.",
        check_dev_isolation,
    ),
    "umbra-no-public-ssh": (
        "No SSH port (22 or the attested SSH port) is reachable from 0.0.0.0/0 or *.",
        check_public_ssh,
    ),
}


def policies() -> list[Any]:
    """The pack's ResourceValidationPolicies (pulumi_policy is imported only here, so the rules
    above stay plain functions)."""
    from pulumi_policy import (
        EnforcementLevel,
        ReportViolation,
        ResourceValidationArgs,
        ResourceValidationPolicy,
    )

    def wrap(rule: Rule) -> Callable[[ResourceValidationArgs, ReportViolation], None]:
        def validate(args: ResourceValidationArgs, report: ReportViolation) -> None:
            for message in rule(args.resource_type, args.props):
                report(message, None)

        return validate

    return [
        ResourceValidationPolicy(
            name=name,
            description=description,
            validate=wrap(rule),
            enforcement_level=EnforcementLevel.MANDATORY,
        )
        for name, (description, rule) in RULES.items()
    ]
