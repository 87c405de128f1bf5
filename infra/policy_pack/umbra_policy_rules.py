"""Rules of the Umbra policy pack, as plain functions of (resource type, props) -> violations.

Props are the engine's camelCase input properties. The pack runs in its own interpreter, so it
imports nothing from umbra; the constants below must equal umbra.components.ports (a test
checks). A value that is unknown at preview is treated as not compliant where it matters.

The pack's one piece of configuration: the Console addresses Dev CVMs may reach on tcp 443 (their
forwarder enrolls there once), declared to the pack itself, not read from the stack it checks:
`--policy-pack-config` file (or the policy group's config in Pulumi Cloud) of the form
`{"umbra-dev-cvm-no-bypass": {"console_ips": ["203.0.113.7"]}}`. Undeclared, no Dev CVM rule or
route may lead anywhere but a Security CVM.
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
CONSOLE_PORT = 443
CONSOLE_IPS_KEY = "console_ips"
MAX_CONSOLE_IPS = 4
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
# Where team networks live (RFC 1918). Python's `is_private` also counts documentation and
# benchmark ranges (198.51.100.0/24, 198.18.0.0/15, ...), which are routed to the internet
# gateway like any public address: they must not pass as "inside the team network".
INTERNAL = tuple(
    ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
)

Props = Mapping[str, Any]
Config = Mapping[str, Any]
Rule = Callable[[str, Props, Config], list[str]]


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


def check_tdx(resource_type: str, props: Props, config: Config) -> list[str]:
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


def _internal(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    return isinstance(net, ipaddress.IPv4Network) and any(net.subnet_of(r) for r in INTERNAL)


def _single_private_hosts(ranges: Iterable[Any]) -> bool:
    seen = False
    for r in ranges:
        seen = True
        try:
            net = ipaddress.ip_network(str(r), strict=True)
        except ValueError:
            return False  # service tags ("Internet", "*"), unknowns, names
        if net.num_addresses != 1 or not _internal(net):
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
        if not _internal(net):
            out.append(str(r))
    return out


def declared_consoles(config: Config) -> tuple[frozenset[str], list[str]]:
    """The pack config's Console addresses as /32 strings, and why any entry was ignored: only a
    single IPv4 host that can be a Console counts (no range, no 0.0.0.0, no metadata address)."""
    raw = config.get(CONSOLE_IPS_KEY) or []
    if not isinstance(raw, list | tuple):
        return frozenset(), [f"pack config {CONSOLE_IPS_KEY} is not a list: ignored"]
    hosts, problems = set(), []
    for entry in raw[:MAX_CONSOLE_IPS]:
        try:
            net = ipaddress.IPv4Network(str(entry), strict=True)
        except ValueError:
            problems.append(f"pack config {CONSOLE_IPS_KEY} entry {entry!r} is not an IPv4 host")
            continue
        addr = net.network_address
        if net.prefixlen != 32:
            problems.append(f"pack config {CONSOLE_IPS_KEY} entry {entry!r} is a range, not a host")
        elif addr.is_unspecified or addr.is_loopback or addr.is_link_local or addr.is_multicast:
            problems.append(f"pack config {CONSOLE_IPS_KEY} entry {entry!r} cannot be a Console")
        elif addr.is_reserved:
            problems.append(f"pack config {CONSOLE_IPS_KEY} entry {entry!r} is reserved")
        else:
            hosts.add(f"{addr}/32")
    if len(raw) > MAX_CONSOLE_IPS:
        problems.append(f"pack config {CONSOLE_IPS_KEY}: more than {MAX_CONSOLE_IPS} entries")
    return frozenset(hosts), problems


def _as_host(value: Any) -> str | None:
    try:
        net = ipaddress.IPv4Network(str(value), strict=True)
    except ValueError:
        return None
    return str(net) if net.prefixlen == 32 else None


def _only_consoles(ranges: Iterable[Any], consoles: frozenset[str]) -> bool:
    """Every destination is a declared Console /32 (and there is at least one)."""
    hosts = [_as_host(r) for r in ranges]
    return bool(hosts) and all(h is not None and h in consoles for h in hosts)


def _gcp_ports_only_console(allows: list[Any]) -> bool:
    return bool(allows) and all(
        _get(a, "protocol") == "tcp" and _list(_get(a, "ports")) == [str(CONSOLE_PORT)]
        for a in allows
    )


def _console_note(consoles: frozenset[str], problems: list[str]) -> str:
    declared = sorted(consoles) or "none declared"
    note = f"; or the Console's declared addresses ({declared}) on tcp:{CONSOLE_PORT}"
    return note + ("" if not problems else f" [{'; '.join(problems)}]")


def check_dev_isolation(resource_type: str, props: Props, config: Config) -> list[str]:
    out: list[str] = []
    consoles, problems = declared_consoles(config)
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
            # A route to a declared Console /32 only: the firewall admits tcp 443 on it.
            if tags != [SECURITY_ROUTE_TAG] and not _only_consoles(dests, consoles):
                out.append(
                    f"internet route to {dests[0]} with tags {tags or 'none (all instances)'}: "
                    f"only the Security CVM ({SECURITY_ROUTE_TAG}) may have one"
                    + _console_note(consoles, problems)
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
            if hop == "Internet" and _only_consoles([dest], consoles):
                continue  # a declared Console /32: the dev NSG admits tcp 443 on it
            if hop in ("Internet", "VirtualAppliance", "VirtualNetworkGateway") and _non_private(
                [dest]
            ):
                out.append(
                    f"route to {dest} via {hop}: only the Security CVM reaches the internet"
                    + _console_note(consoles, problems)
                )
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
            allows = _list(props.get("allows"))
            # One kind per rule: a GCP rule's ports apply to all its destinations.
            tunnel = _single_private_hosts(dests) and _gcp_ports_only_tunnel(allows)
            console = _only_consoles(dests, consoles) and _gcp_ports_only_console(allows)
            if not (tunnel or console):
                out.append(
                    f"egress rule for Dev CVMs allows {dests or 'every destination'} "
                    f"({allows}): only the Security CVM's address on tcp:{SECURITY_TUNNEL_PORT}"
                    + _console_note(consoles, problems)
                )
    elif resource_type == AZ_NSG and _role(props, "tags") == ROLE_DEV:
        for rule in _list(props.get("securityRules")):
            if _get(rule, "direction") == "Outbound" and _get(rule, "access") == "Allow":
                dests = _azure_prefixes(rule, "destination")
                ports = _azure_ports(rule)
                tunnel = _single_private_hosts(dests) and ports == [(SECURITY_TUNNEL_PORT,) * 2]
                console = (
                    _only_consoles(dests, consoles)
                    and ports == [(CONSOLE_PORT,) * 2]
                    and str(_get(rule, "protocol")).lower() == "tcp"
                )
                if not (tunnel or console):
                    out.append(
                        f"Dev CVM NSG rule {_get(rule, 'name')!r} allows outbound to {dests} "
                        f"ports {ports} ({_get(rule, 'protocol')}): only the Security CVM on "
                        f"{SECURITY_TUNNEL_PORT}" + _console_note(consoles, problems)
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


def check_public_ssh(resource_type: str, props: Props, config: Config) -> list[str]:
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


# The bypass policy's configuration (see the module docstring); the others take none.
CONSOLE_CONFIG_SCHEMA: dict[str, dict[str, Any]] = {
    CONSOLE_IPS_KEY: {
        "type": "array",
        "items": {"type": "string"},
        "maxItems": MAX_CONSOLE_IPS,
        "default": [],
        "description": "The Console's IPv4 addresses Dev CVMs may reach on tcp 443 (enrollment).",
    }
}

RULES: dict[str, tuple[str, Rule]] = {
    "umbra-cvm-requires-tdx": (
        "Every VM, template and scale set is an Intel TDX confidential VM on a TDX machine type.",
        check_tdx,
    ),
    "umbra-dev-cvm-no-bypass": (
        "No VM but the Console has an external IP; no route or rule lets a Dev CVM around its "
        "Security CVM (but to the Console's declared addresses on tcp 443).",
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
        PolicyConfigSchema,
        ReportViolation,
        ResourceValidationArgs,
        ResourceValidationPolicy,
    )

    def wrap(rule: Rule) -> Callable[[ResourceValidationArgs, ReportViolation], None]:
        def validate(args: ResourceValidationArgs, report: ReportViolation) -> None:
            for message in rule(args.resource_type, args.props, args.get_config() or {}):
                report(message, None)

        return validate

    return [
        ResourceValidationPolicy(
            name=name,
            description=description,
            validate=wrap(rule),
            enforcement_level=EnforcementLevel.MANDATORY,
            config_schema=PolicyConfigSchema(CONSOLE_CONFIG_SCHEMA)
            if rule is check_dev_isolation
            else None,
        )
        for name, (description, rule) in RULES.items()
    ]
