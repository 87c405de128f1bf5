"""Run Pulumi programs in-process with `pulumi.runtime.set_mocks` (no CLI, no cloud) and keep
every registered resource, with its camelCase inputs as the engine and policy packs see them."""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi
import yaml
from pulumi.runtime import MockCallArgs, MockResourceArgs, Mocks

ROOT = Path(__file__).resolve().parents[2]
# A real (self-signed, throwaway) certificate: the launch agent parses what the stack delivers.
FAKE_DB_CA = """-----BEGIN CERTIFICATE-----
MIIBnDCCAUGgAwIBAgIULmFKRx8TSMZ67xOab8XGW7fAKgEwCgYIKoZIzj0EAwIw
IzEhMB8GA1UEAwwYRmFrZSBDbG91ZCBTUUwgU2VydmVyIENBMB4XDTI2MTIwNjA4
MDkwOFoXDTM2MTIwMzA4MDkwOFowIzEhMB8GA1UEAwwYRmFrZSBDbG91ZCBTUUwg
U2VydmVyIENBMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEZhX+5v8sFhr+BDpX
MYBrbCmsVQZqp4ZBhe19rOViSNLijbGkHZag9X1ap4OW79+odvrDK8ToS+LrhJJC
/bE9jaNTMFEwHQYDVR0OBBYEFIPSvghZMeyoWJiiCnRPdjmX2/fnMB8GA1UdIwQY
MBaAFIPSvghZMeyoWJiiCnRPdjmX2/fnMA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZI
zj0EAwIDSQAwRgIhAMi3l764HKVIQwZJfZUsrWMJIL7kNOC9NB2pupGaw7JHAiEA
4niJib42dqpAS8SgH+AZxR0OuUHYqUodzCs11RosUbc=
-----END CERTIFICATE-----
"""
STACKS = ROOT / "stacks"


@dataclass(frozen=True)
class Res:
    typ: str
    name: str
    inputs: Mapping[str, Any]
    outputs: Mapping[str, Any]


class Recorder(Mocks):
    def __init__(self, stack_outputs: Mapping[str, Any] | None = None) -> None:
        self.resources: list[Res] = []
        # Resource options by (type, name): the mock monitor never sees them.
        self.options: dict[tuple[str, str], pulumi.ResourceOptions] = {}
        self.stack_outputs = dict(stack_outputs or {})
        self._next_ip = 100

    def new_resource(self, args: MockResourceArgs) -> tuple[str | None, dict[str, Any]]:
        out: dict[str, Any] = dict(args.inputs)
        out.setdefault("name", args.name)
        if args.typ == "gcp:serviceaccount/account:Account":
            out["email"] = (
                f"{args.inputs['accountId']}@{args.inputs['project']}.iam.gserviceaccount.com"
            )
        if args.typ == "gcp:compute/instance:Instance":
            out["instanceId"] = f"{args.name}-instance-id"
            out["selfLink"] = f"zones/{args.inputs.get('zone')}/instances/{args.inputs['name']}"
            nis = [dict(ni) for ni in out.get("networkInterfaces", [])]
            for ni in nis:
                if not ni.get("networkIp"):
                    self._next_ip += 1
                    ni["networkIp"] = f"10.99.0.{self._next_ip}"
            out["networkInterfaces"] = nis
        if args.typ == "gcp:sql/databaseInstance:DatabaseInstance":
            out["serverCaCerts"] = [{"cert": FAKE_DB_CA}]
            out["privateIpAddress"] = "10.10.128.5"
        if args.typ == "gcp:compute/address:Address":
            out["address"] = "198.51.100.7"  # what GCP reserves (documentation range here)
        if args.typ == "gcp:compute/instanceTemplate:InstanceTemplate":
            out["selfLinkUnique"] = f"global/instanceTemplates/{args.name}?uniqueId=1"
        if args.typ == "gcp:compute/regionInstanceGroupManager:RegionInstanceGroupManager":
            out["instanceGroup"] = f"regions/{args.inputs['region']}/instanceGroups/{args.name}"
        if args.typ == "azure-native:network:PublicIPAddress":
            out["ipAddress"] = "203.0.113.80"
        if args.typ == "gcp:compute/disk:Disk":
            out["selfLink"] = f"zones/{args.inputs.get('zone')}/disks/{args.inputs['name']}"
        if args.typ == "gcp:secretmanager/secret:Secret":
            out["secretId"] = args.inputs["secretId"]
            out["id"] = f"projects/{args.inputs['project']}/secrets/{args.inputs['secretId']}"
            self.resources.append(Res(args.typ, args.name, dict(args.inputs), out))
            return out["id"], out
        if args.typ == "gcp:secretmanager/secretVersion:SecretVersion":
            out["name"] = f"{args.inputs['secret']}/versions/1"
            out["version"] = "1"
        if args.typ == "azure-native:dbforpostgresql:Server":
            out["fullyQualifiedDomainName"] = (
                f"{args.inputs['serverName']}.postgres.database.azure.com"
            )
        if args.typ == "azure-native:keyvault:Vault":
            out["name"] = args.inputs["vaultName"]  # as Azure names it
        if args.typ == "azure-native:keyvault:Secret":
            vault, secret = args.inputs["vaultName"], args.inputs["secretName"]
            props = dict(out.get("properties", {}))
            props = dict(props.get("value", {})) if len(props) == 2 and "value" in props else props
            out["properties"] = props | {
                "secretUriWithVersion": f"https://{vault}.vault.azure.net/secrets/{secret}/{'0' * 32}"
            }
        if args.typ == "azure-native:compute:VirtualMachine":
            out["vmId"] = f"{args.name}-vm-id"
        if args.typ == "pulumi:pulumi:StackReference":
            out["outputs"] = self.stack_outputs
        self.resources.append(Res(args.typ, args.name, dict(args.inputs), out))
        return f"{args.name}-id", out

    def call(self, args: MockCallArgs) -> tuple[dict[str, Any], list[tuple[str, str]] | None]:
        if args.token == "azure-native:authorization:getClientConfig":
            return {
                "subscriptionId": "sub-0000",
                "tenantId": "t",
                "clientId": "c",
                "objectId": "o",
            }, []
        return {}, []

    def of_type(self, typ: str) -> list[Res]:
        return [r for r in self.resources if r.typ == typ]

    def one(self, typ: str, name: str) -> Res:
        found = [r for r in self.resources if r.typ == typ and r.name == name]
        assert len(found) == 1, f"{typ} {name}: {[r.name for r in self.of_type(typ)]}"
        return found[0]


def run_program(
    body: Callable[[], Any],
    stack_outputs: Mapping[str, Any] | None = None,
    config: Mapping[str, str] | None = None,
) -> tuple[Recorder, Any]:
    """Run `body` as a Pulumi program; returns the recorder and body's result, its Outputs
    resolved (so assertions can read them)."""
    try:
        asyncio.get_event_loop()
    except RuntimeError:  # a module-scoped fixture runs before the per-test loop exists
        asyncio.set_event_loop(asyncio.new_event_loop())
    mocks = Recorder(stack_outputs)
    pulumi.runtime.set_mocks(mocks, project="umbra", stack="test", preview=False)
    if config is not None:  # the program sees exactly this config
        pulumi.runtime.set_all_config(dict(config))
    holder: dict[str, Any] = {}
    original = pulumi.Resource.__init__

    def recording_init(
        self: pulumi.Resource,
        t: str,
        name: str,
        custom: bool,
        props: Any = None,
        opts: pulumi.ResourceOptions | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        mocks.options[(t, name)] = opts or pulumi.ResourceOptions()
        original(self, t, name, custom, props, opts, *args, **kwargs)

    @pulumi.runtime.test  # type: ignore[untyped-decorator]
    def program() -> Any:
        result = body()
        return pulumi.Output.from_input(result).apply(lambda v: holder.__setitem__("v", v))

    pulumi.Resource.__init__ = recording_init  # type: ignore[method-assign]
    try:
        program()
    finally:
        pulumi.Resource.__init__ = original  # type: ignore[method-assign]
        if config is not None:
            pulumi.runtime.set_all_config({})
    return mocks, holder.get("v")


def example_raw(stack: str) -> dict[str, str]:
    """A stack file's config as Pulumi hands it to the program (objects JSON-encoded)."""
    doc = yaml.safe_load((STACKS / f"Pulumi.{stack}.yaml").read_text())["config"]
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in doc.items()}


def example_stack(stack: str) -> dict[str, Any]:
    doc = yaml.safe_load((STACKS / f"Pulumi.{stack}.yaml").read_text())["config"]
    return dict(doc["umbra:stack"])


def raw_of(stack: Mapping[str, Any]) -> dict[str, str]:
    return {"umbra:stack": json.dumps(stack)}


def console_stack(cloud: str) -> dict[str, Any]:
    """The example Console stack (console-gcp), or the same Console on Azure."""
    doc = example_stack("console-gcp")
    if cloud == "azure":
        del doc["gcp"]
        doc |= {
            "cloud": "azure",
            "azure": {"location": "westeurope"},
            "db_tier": "Standard_D2ds_v5",
        }
        doc["vm"] = doc["vm"] | {
            "size": "Standard_DC4es_v5",
            "image": "Canonical:ubuntu-24_04-lts:cvm:latest",
        }
    return doc


def build_console_exports(
    cfg: Any, config: Mapping[str, str], root: Path = ROOT
) -> tuple[Recorder, dict[str, Any]]:
    """Build the Console stack `cfg` (a ConsoleStack) with `config` as the program's config;
    returns the mocks and the stack's exports, resolved."""
    from umbra.components.program import build_console

    exported: dict[str, Any] = {}
    original = pulumi.export

    def body() -> Any:
        pulumi.export = lambda name, value: exported.__setitem__(name, value)
        try:
            build_console(cfg, root)
        finally:
            pulumi.export = original
        return pulumi.Output.all(**exported)

    mocks, values = run_program(body, config=config)
    return mocks, dict(values)


# --- tiny firewall evaluators: which flows the rules we built let through ---------------------


def _in(ip: str, ranges: list[str]) -> bool:
    return any(ipaddress.ip_address(ip) in ipaddress.ip_network(r) for r in ranges)


def _gcp_ports_match(entries: list[Mapping[str, Any]], port: int) -> bool:
    for e in entries:
        if e["protocol"] == "all":
            return True
        if e["protocol"] == "tcp":
            ports = e.get("ports") or []
            if not ports:
                return True
            for p in ports:
                lo, _, hi = str(p).partition("-")
                if int(lo) <= port <= int(hi or lo):
                    return True
    return False


def gcp_allows(
    firewalls: list[Res],
    *,
    direction: str,
    target_sa: str,
    peer_ip: str,
    port: int,
    peer_sa: str | None = None,
) -> bool:
    """GCP semantics: the matching rule with the lowest priority number wins, deny beats allow
    at equal priority, no match means the implied rule (deny ingress, allow egress)."""
    best: tuple[float, int, bool] | None = None
    for fw in firewalls:
        f = fw.inputs
        if f.get("direction", "INGRESS") != direction:
            continue
        targets = f.get("targetServiceAccounts")
        if targets and target_sa not in targets:
            continue
        if direction == "EGRESS":
            if not _in(peer_ip, f.get("destinationRanges", [])):
                continue
        else:
            by_range = _in(peer_ip, f.get("sourceRanges", []))
            by_sa = peer_sa is not None and peer_sa in f.get("sourceServiceAccounts", [])
            if not (by_range or by_sa):
                continue
        allows, denies = f.get("allows", []), f.get("denies", [])
        for entries, allowed in ((denies, False), (allows, True)):
            if entries and _gcp_ports_match(entries, port):
                key = (float(f.get("priority", 1000)), 0 if not allowed else 1, allowed)
                if best is None or key < best:
                    best = key
    if best is None:
        return direction == "EGRESS"
    return best[2]


def azure_allows(nsg: Res, *, direction: str, src: str, dst: str, port: int) -> bool:
    """NSG semantics: the matching rule with the lowest priority wins; the platform defaults
    (allow VNet both ways, allow internet outbound, deny the rest) come after 4096."""
    rules = sorted(nsg.inputs.get("securityRules", []), key=lambda r: r["priority"])
    for r in rules:
        if r["direction"] != direction:
            continue
        if not _az_match(r, "source", src) or not _az_match(r, "destination", dst):
            continue
        specs = ([r["destinationPortRange"]] if r.get("destinationPortRange") else []) + list(
            r.get("destinationPortRanges", [])
        )
        if "*" not in specs and str(port) not in specs:
            continue
        return bool(r["access"] == "Allow")
    return True  # the platform defaults would allow VNet traffic: our rules must decide first


def _az_match(rule: Mapping[str, Any], side: str, ip: str) -> bool:
    prefixes = ([rule[f"{side}AddressPrefix"]] if rule.get(f"{side}AddressPrefix") else []) + list(
        rule.get(f"{side}AddressPrefixes", [])
    )
    for p in prefixes:
        if p == "*":
            return True
        if p == "Internet":
            if ipaddress.ip_address(ip).is_global:
                return True
            continue
        if p == "AzureLoadBalancer":
            if ip == "168.63.129.16":
                return True
            continue
        if p == "AzurePlatformDNS":
            if ip == "168.63.129.16":
                return True
            continue
        if ipaddress.ip_address(ip) in ipaddress.ip_network(p):
            return True
    return False
