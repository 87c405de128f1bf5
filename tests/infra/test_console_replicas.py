"""Console replicas in the Console stack (`replicas`), under mocks: GCP a regional managed
instance group of TDX instances behind an external passthrough TCP load balancer on the
Console's static address, Azure N confidential VMs behind a public Standard load balancer; the
same launch data on every replica, TLS on the VMs (TCP forwarding, never an HTTPS proxy), and
health checkers admitted on the Console's port only. `replicas: 1` declares today's resources."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from tests.infra.harness import Recorder, build_console_exports
from tests.infra.test_console_service import PASSWORD, _raw
from tests.infra.test_policy_pack import violations
from umbra.components.config import ConfigError, ConsoleStack, parse_stack_config
from umbra.components.console_pool import GCP_NLB_HEALTH_RANGES

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SECRETS = frozenset({"umbra:consoleDbPassword", "umbra:consoleWebSessionKey"})
# Every replica keys its web cookies with it (required for replicas > 1).
WEB_KEY = base64.b64encode(b"replicas-share-this-web-key-32b!").decode()
LB_TYPES = {
    "gcp:compute/instanceTemplate:InstanceTemplate",
    "gcp:compute/regionInstanceGroupManager:RegionInstanceGroupManager",
    "gcp:compute/regionHealthCheck:RegionHealthCheck",
    "gcp:compute/regionBackendService:RegionBackendService",
    "gcp:compute/forwardingRule:ForwardingRule",
    "gcp:compute/router:Router",
    "gcp:compute/routerNat:RouterNat",
    "azure-native:network:LoadBalancer",
}


def _build(cloud: str, **changes: Any) -> tuple[Recorder, dict[str, Any]]:
    raw = _raw(cloud) | {"umbra:consoleWebSessionKey": WEB_KEY}
    if changes:
        raw["umbra:stack"] = json.dumps(json.loads(raw["umbra:stack"]) | changes)
    cfg = parse_stack_config(raw, SECRETS)
    assert isinstance(cfg, ConsoleStack)
    return build_console_exports(cfg, raw)


def _urns(mocks: Recorder) -> set[tuple[str, str]]:
    return {(r.typ, r.name) for r in mocks.resources}


@pytest.mark.parametrize("cloud", ["gcp", "azure"])
def test_one_replica_declares_exactly_todays_resources(cloud: str) -> None:
    """Existing stacks don't churn: `replicas: 1` (and no setting) is the single VM."""
    default, _ = _build(cloud)
    one, _ = _build(cloud, replicas=1)
    assert _urns(default) == _urns(one)
    assert not {r.typ for r in one.resources} & LB_TYPES
    vm = (
        "gcp:compute/instance:Instance" if cloud == "gcp" else "azure-native:compute:VirtualMachine"
    )
    assert len(one.of_type(vm)) == 1
    if cloud == "azure":
        (nsg,) = one.of_type("azure-native:network:NetworkSecurityGroup")
        assert [r["name"] for r in nsg.inputs["securityRules"]] == ["https-in", "deny-all-inbound"]


@pytest.mark.parametrize("bad", [0, 9, "two"])
def test_replicas_out_of_bounds_is_refused(bad: Any) -> None:
    raw = _raw("gcp")
    raw["umbra:stack"] = json.dumps(json.loads(raw["umbra:stack"]) | {"replicas": bad})
    with pytest.raises(ConfigError) as err:
        parse_stack_config(raw, SECRETS)
    assert "replicas" in str(err.value)


@pytest.mark.parametrize("cloud", ["gcp", "azure"])
def test_replicas_need_a_shared_web_session_key(cloud: str) -> None:
    """Without one each replica keys its cookies at random: a login on one is refused by the
    others. Refused by name; one replica may go without."""
    raw = _raw(cloud)
    raw["umbra:stack"] = json.dumps(json.loads(raw["umbra:stack"]) | {"replicas": 2})
    with pytest.raises(ConfigError, match=r"umbra:consoleWebSessionKey: required with replicas 2"):
        parse_stack_config(raw, SECRETS)
    assert isinstance(parse_stack_config(_raw(cloud), SECRETS), ConsoleStack)


def test_gcp_replicas_are_a_managed_group_behind_a_passthrough_lb() -> None:
    single, single_out = _build("gcp")
    mocks, exported = _build("gcp", replicas=3)
    assert not mocks.of_type("gcp:compute/instance:Instance")
    (template,) = mocks.of_type("gcp:compute/instanceTemplate:InstanceTemplate")
    assert template.inputs["confidentialInstanceConfig"]["confidentialInstanceType"] == "TDX"
    assert template.inputs["scheduling"]["onHostMaintenance"] == "TERMINATE"
    assert template.inputs["shieldedInstanceConfig"]["enableVtpm"] is True
    (ni,) = template.inputs["networkInterfaces"]
    assert not ni.get("accessConfigs")  # no public address on a replica
    # Every replica boots the launch data the single VM boots, plus the balancer's address
    # (`umbra-lb-ip`, fails before the fix: without it a replica drops the balancer's packets).
    (vm,) = single.of_type("gcp:compute/instance:Instance")
    (address,) = mocks.of_type("gcp:compute/address:Address")
    replica_meta = dict(template.inputs["metadata"])
    assert address.outputs["address"]
    assert replica_meta.pop("umbra-lb-ip") == address.outputs["address"]
    assert replica_meta == vm.inputs["metadata"]
    # ... which names the one web session key every replica reads (by reference, measured).
    assert replica_meta["umbra-console-web-session-key-ref"].endswith("web-session-key/versions/1")
    assert "umbra-lb-ip" not in vm.inputs["metadata"]
    assert template.inputs["serviceAccount"] == vm.inputs["serviceAccount"]

    checks = {c.name: c for c in mocks.of_type("gcp:compute/regionHealthCheck:RegionHealthCheck")}
    ready, live = checks["console-pool-ready"], checks["console-pool-live"]
    assert ready.inputs["httpsHealthCheck"] == {"port": 443, "requestPath": "/readyz"}
    assert live.inputs["httpsHealthCheck"] == {"port": 443, "requestPath": "/healthz"}
    (group,) = mocks.of_type("gcp:compute/regionInstanceGroupManager:RegionInstanceGroupManager")
    assert group.inputs["targetSize"] == 3
    assert group.inputs["region"] == "us-central1"
    assert group.inputs["distributionPolicyZones"] == ["us-central1-a"]
    assert group.inputs["versions"][0]["instanceTemplate"] == template.outputs["selfLinkUnique"]
    # Autohealing on liveness only: a database outage must not recreate every replica.
    assert group.inputs["autoHealingPolicies"]["healthCheck"] == f"{live.name}-id"
    (backend,) = mocks.of_type("gcp:compute/regionBackendService:RegionBackendService")
    # TCP passthrough: the LB never terminates TLS, the Console VMs do.
    assert (backend.inputs["loadBalancingScheme"], backend.inputs["protocol"]) == (
        "EXTERNAL",
        "TCP",
    )
    assert backend.inputs["sessionAffinity"] == "CLIENT_IP"
    assert backend.inputs["healthChecks"] == f"{ready.name}-id"  # traffic to ready replicas
    assert backend.inputs["backends"][0]["group"] == group.outputs["instanceGroup"]
    (rule,) = mocks.of_type("gcp:compute/forwardingRule:ForwardingRule")
    assert rule.inputs["ipProtocol"] == "TCP" and rule.inputs["ports"] == ["443"]
    assert rule.inputs["loadBalancingScheme"] == "EXTERNAL"
    # The same reserved address (same resource) team stacks pin, now the LB's.
    (address,) = mocks.of_type("gcp:compute/address:Address")
    (single_address,) = single.of_type("gcp:compute/address:Address")
    assert address.name == single_address.name
    assert rule.inputs["ipAddress"] == "198.51.100.7" == exported["console_public_ip"]
    assert single_out["console_public_ip"] == exported["console_public_ip"]
    # No HTTPS proxy, SSL certificate or target proxy anywhere: the key stays in the CVM.
    assert not [r for r in mocks.resources if "ssl" in r.typ.lower() or "Proxy" in r.typ]
    assert mocks.of_type("gcp:compute/routerNat:RouterNat")  # egress without public addresses


def test_gcp_health_checkers_are_admitted_on_the_console_port_only() -> None:
    single, _ = _build("gcp")
    mocks, _ = _build("gcp", replicas=2)
    before = {f.name: f.inputs for f in single.of_type("gcp:compute/firewall:Firewall")}
    after = {f.name: f.inputs for f in mocks.of_type("gcp:compute/firewall:Firewall")}
    added = set(after) - set(before)
    assert added == {"console-pool-lb-health-in"}
    assert {k: after[k] for k in before} == before  # client ingress unchanged
    health = after["console-pool-lb-health-in"]
    assert sorted(health["sourceRanges"]) == sorted(GCP_NLB_HEALTH_RANGES)
    assert health["allows"] == [{"protocol": "tcp", "ports": ["443"]}]
    assert health["targetServiceAccounts"] == before["console-https-in"]["targetServiceAccounts"]


def test_azure_replicas_are_confidential_vms_behind_a_standard_lb() -> None:
    single, _ = _build("azure")
    mocks, exported = _build("azure", replicas=3)
    vms = mocks.of_type("azure-native:compute:VirtualMachine")
    assert sorted(v.inputs["vmName"] for v in vms) == [
        "umbra-console",
        "umbra-console-1",
        "umbra-console-2",
    ]
    (one,) = single.of_type("azure-native:compute:VirtualMachine")
    for vm in vms:
        assert vm.inputs["securityProfile"]["securityType"] == "ConfidentialVM"
        assert vm.inputs["userData"] == one.inputs["userData"]  # the same launch data
    (lb,) = mocks.of_type("azure-native:network:LoadBalancer")
    assert lb.inputs["sku"] == {"name": "Standard"}
    (probe,) = lb.inputs["probes"]
    assert (probe["protocol"], probe["port"], probe["requestPath"]) == ("Https", 443, "/readyz")
    (rule,) = lb.inputs["loadBalancingRules"]
    assert (rule["protocol"], rule["frontendPort"], rule["backendPort"]) == ("Tcp", 443, 443)
    assert rule["enableFloatingIP"] is False and rule["loadDistribution"] == "SourceIP"
    # Only the LB's frontend holds a public address; each NIC joins its pool.
    (pip,) = mocks.of_type("azure-native:network:PublicIPAddress")
    assert lb.inputs["frontendIPConfigurations"][0]["publicIPAddress"] == {"id": f"{pip.name}-id"}
    assert exported["console_public_ip"] == "203.0.113.80"
    nics = mocks.of_type("azure-native:network:NetworkInterface")
    assert len(nics) == 3
    for nic in nics:
        (cfg,) = nic.inputs["ipConfigurations"]
        assert "publicIPAddress" not in cfg
        assert cfg["loadBalancerBackendAddressPools"] == [
            {"id": f"{lb.name}-id/backendAddressPools/replicas"}
        ]
    # Each replica's identity reads the launch secrets and holds the provisioner's role.
    roles = [
        r.inputs["roleDefinitionId"].rsplit("/", 1)[1]
        for r in mocks.of_type("azure-native:authorization:RoleAssignment")
    ]
    assert roles.count("4633458b-17de-408a-b874-0445c86b69e6") == 3
    assert roles.count("9980e02c-c2be-4d73-94e8-173b1dc7cf3c") == 3
    # The NSG admits Azure's probe to 443 only; the deny-all still follows.
    (nsg,) = mocks.of_type("azure-native:network:NetworkSecurityGroup")
    rules = {r["name"]: r for r in nsg.inputs["securityRules"]}
    assert set(rules) == {"https-in", "lb-probe-in", "deny-all-inbound"}
    probe_rule = rules["lb-probe-in"]
    assert probe_rule["sourceAddressPrefix"] == "AzureLoadBalancer"
    assert probe_rule["destinationPortRange"] == "443" and probe_rule["access"] == "Allow"
    assert probe_rule["priority"] < rules["deny-all-inbound"]["priority"]


@pytest.mark.parametrize("cloud", ["gcp", "azure"])
def test_replicas_pass_the_policy_pack_and_keep_the_password_in_its_holders(cloud: str) -> None:
    mocks, _ = _build(cloud, replicas=2)
    for r in mocks.resources:
        assert violations(r.typ, dict(r.inputs)) == {}, (r.typ, r.name)
    holders = {
        r.typ
        for r in mocks.resources
        for secret in (PASSWORD, WEB_KEY)
        if secret in json.dumps(r.inputs)
    }
    assert holders <= {
        "gcp:sql/user:User",
        "gcp:secretmanager/secretVersion:SecretVersion",
        "azure-native:dbforpostgresql:Server",
        "azure-native:keyvault:Secret",
    }


# --- the Dev CVM stacks' state backend and secrets provider (`dev_state`) ----------------------


def test_dev_state_declares_a_private_bucket_and_a_kms_key_for_the_console_only() -> None:
    plain, _ = _build("gcp")
    assert not plain.of_type("gcp:storage/bucket:Bucket")  # default: nothing new
    mocks, exported = _build("gcp", dev_state=True)
    (bucket,) = mocks.of_type("gcp:storage/bucket:Bucket")
    assert bucket.inputs["name"] == "umbra-control-umbra-console-state"
    assert bucket.inputs["publicAccessPrevention"] == "enforced"
    assert bucket.inputs["uniformBucketLevelAccess"] is True
    assert bucket.inputs["versioning"] == {"enabled": True}
    (key,) = mocks.of_type("gcp:kms/cryptoKey:CryptoKey")
    assert mocks.options[("gcp:kms/cryptoKey:CryptoKey", key.name)].protect is True
    sa = "serviceAccount:umbra-console@umbra-control.iam.gserviceaccount.com"
    (use,) = mocks.of_type("gcp:kms/cryptoKeyIAMMember:CryptoKeyIAMMember")
    assert (use.inputs["role"], use.inputs["member"]) == (
        "roles/cloudkms.cryptoKeyEncrypterDecrypter",
        sa,
    )
    (grant,) = mocks.of_type("gcp:storage/bucketIAMMember:BucketIAMMember")
    assert (grant.inputs["bucket"], grant.inputs["member"]) == (bucket.inputs["name"], sa)
    assert exported["dev_state_backend_url"] == "gs://umbra-control-umbra-console-state"
    assert exported["dev_secrets_provider"] == (
        "gcpkms://projects/umbra-control/locations/us-central1/keyRings/umbra-console/"
        "cryptoKeys/dev-cvm-stacks"
    )
    # What the stack exports is what the Console's provisioner accepts.
    from tests.infra.test_automation import GCP
    from umbra.components.automation import PulumiDevCvmProvisioner

    PulumiDevCvmProvisioner(
        GCP,
        backend_url=exported["dev_state_backend_url"],
        secrets_provider=exported["dev_secrets_provider"],
    )


@pytest.mark.parametrize(
    ("cloud", "changes", "problem"),
    [
        ("gcp", {"dev_state": True, "state_bucket": "umbra-state"}, "unset state_bucket"),
        ("azure", {"dev_state": True, "state_scope": "/subscriptions/s/x"}, "state_scope"),
    ],
)
def test_dev_state_conflicts_are_refused(cloud: str, changes: dict[str, Any], problem: str) -> None:
    raw = _raw(cloud)
    raw["umbra:stack"] = json.dumps(json.loads(raw["umbra:stack"]) | changes)
    with pytest.raises(ConfigError) as err:
        parse_stack_config(raw, SECRETS)
    assert problem in str(err.value)


@pytest.mark.parametrize("replicas", [1, 2])
def test_azure_dev_state_is_a_keyless_container_and_a_vault_key_for_each_identity(
    replicas: int,
) -> None:
    mocks, exported = _build("azure", dev_state=True, replicas=replicas)
    for r in mocks.resources:
        assert violations(r.typ, dict(r.inputs)) == {}, (r.typ, r.name)
    (account,) = mocks.of_type("azure-native:storage:StorageAccount")
    assert account.inputs["allowSharedKeyAccess"] is False
    assert account.inputs["allowBlobPublicAccess"] is False
    (container,) = mocks.of_type("azure-native:storage:BlobContainer")
    assert container.inputs["publicAccess"] == "None"
    (key,) = mocks.of_type("azure-native:keyvault:Key")
    assert mocks.options[("azure-native:keyvault:Key", key.name)].protect is True
    by_role: dict[str, list[str]] = {}
    for r in mocks.of_type("azure-native:authorization:RoleAssignment"):
        by_role.setdefault(r.inputs["roleDefinitionId"].rsplit("/", 1)[1], []).append(
            r.inputs["scope"]
        )
    # Every replica's identity: blob data on the container only, crypto on the key only.
    assert by_role["ba92f5b4-2d11-453d-a403-e96b0029c9fe"] == [f"{container.name}-id"] * replicas
    assert by_role["12338af0-0e69-4776-bea7-57ae8d297424"] == [f"{key.name}-id"] * replicas
    account_name = account.inputs["accountName"]
    assert exported["dev_state_backend_url"] == (
        f"azblob://dev-cvm-stacks?storage_account={account_name}"
    )
    vault = key.inputs["vaultName"]
    assert exported["dev_secrets_provider"] == (
        f"azurekeyvault://{vault}.vault.azure.net/keys/dev-cvm-stacks"
    )
    from tests.infra.test_automation import AZURE
    from umbra.components.automation import PulumiDevCvmProvisioner

    PulumiDevCvmProvisioner(
        AZURE,
        backend_url=exported["dev_state_backend_url"],
        secrets_provider=exported["dev_secrets_provider"],
    )
