"""ConsoleService under mocks on both clouds: the Console's VM is a TDX CVM, PostgreSQL has no
public address, the password only travels as a secret, and the policy pack accepts it all."""

from __future__ import annotations

import copy
import json
from typing import Any

import pulumi
import pytest

from tests.infra.harness import (
    FAKE_DB_CA,
    ROOT,
    build_console_exports,
    console_stack,
    example_raw,
    example_stack,
    raw_of,
    run_program,
)
from tests.infra.test_policy_pack import violations
from umbra.components.config import ConsoleStack, parse_stack_config
from umbra.components.console_service import ConsoleService
from umbra.components.launch_data import DATABASE_CA_PATH
from umbra.components.program import build_console

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PASSWORD = "a-very-secret-db-password"


def _raw(cloud: str) -> dict[str, str]:
    raw = example_raw("console-gcp") if cloud == "gcp" else raw_of(console_stack(cloud))
    return raw | {"umbra:consoleDbPassword": PASSWORD}


@pytest.mark.parametrize("cloud", ["gcp", "azure"])
def test_console_service(cloud: str) -> None:
    cfg = parse_stack_config(_raw(cloud), frozenset({"umbra:consoleDbPassword"}))
    assert isinstance(cfg, ConsoleStack)

    def body() -> Any:
        from pulumi.runtime import config as runtime_config

        runtime_config.set_all_config(_raw(cloud), ["umbra:consoleDbPassword"])
        try:
            build_console(cfg, ROOT)
        finally:
            runtime_config.set_all_config({}, [])
        return None

    mocks, _ = run_program(body)
    if cloud == "gcp":
        (db,) = mocks.of_type("gcp:sql/databaseInstance:DatabaseInstance")
        ip = db.inputs["settings"]["ipConfiguration"]
        assert ip["ipv4Enabled"] is False and ip["sslMode"] == "ENCRYPTED_ONLY"
        (vm,) = mocks.of_type("gcp:compute/instance:Instance")
        assert vm.inputs["confidentialInstanceConfig"]["confidentialInstanceType"] == "TDX"
    else:
        (db,) = mocks.of_type("azure-native:dbforpostgresql:Server")
        assert db.inputs["network"]["publicNetworkAccess"] == "Disabled"
        (vm,) = mocks.of_type("azure-native:compute:VirtualMachine")
        assert vm.inputs["securityProfile"]["securityType"] == "ConfidentialVM"
    # The password reaches the database resource and the Console's secret store, nothing else.
    holders = [r for r in mocks.resources if PASSWORD in json.dumps(r.inputs)]
    assert {r.typ for r in holders} <= {
        "gcp:sql/user:User",
        "gcp:secretmanager/secretVersion:SecretVersion",
        "azure-native:dbforpostgresql:Server",
        "azure-native:keyvault:Secret",
    }, [r.typ for r in holders]
    for r in mocks.resources:
        assert violations(r.typ, dict(r.inputs)) == {}, (r.typ, r.name)


def test_database_url_is_a_secret_output() -> None:
    cfg = parse_stack_config(_raw("gcp"), frozenset({"umbra:consoleDbPassword"}))
    assert isinstance(cfg, ConsoleStack)
    from umbra.components.console_service import ConsoleServiceArgs

    def body() -> Any:
        assert cfg.gcp is not None
        svc = ConsoleService(
            "c",
            ConsoleServiceArgs(
                name="console",
                cloud="gcp",
                gcp=cfg.gcp,
                cidr="10.10.0.0/24",
                ingress_cidrs=["203.0.113.0/24"],
                vm_size="c3-standard-4",
                vm_image="img",
                console_image=cfg.console_image,
                app_compose='{"docker_compose_file":"services: {}\\n"}',
                db_tier="db-custom-2-7680",
                db_password=PASSWORD,
            ),
        )
        return pulumi.Output.all(
            svc.database_url,
            pulumi.Output.from_input(svc.database_url.is_secret()),  # type: ignore[arg-type]
        )

    _, (url, is_secret) = run_program(body)
    assert url.startswith("postgresql://umbra_console:" + PASSWORD + "@")
    assert is_secret is True


def _console(doc_changes: dict[str, Any], root: Any = ROOT) -> tuple[Any, dict[str, Any]]:
    """Build the Console stack; returns the mocks and its exports, resolved."""
    doc = copy.deepcopy(example_stack("console-gcp")) | doc_changes
    raw = {"umbra:stack": json.dumps(doc), "umbra:consoleDbPassword": PASSWORD}
    cfg = parse_stack_config(raw, frozenset({"umbra:consoleDbPassword"}))
    assert isinstance(cfg, ConsoleStack)
    return build_console_exports(cfg, raw, root)


def test_the_console_service_account_holds_exactly_the_provisioner_roles() -> None:
    mocks, _ = _console(
        {"team_projects": ["acme-umbra", "globex-umbra"], "state_bucket": "umbra-state"}
    )
    grants = sorted(
        (m.inputs["project"], m.inputs["role"], m.inputs["member"])
        for m in mocks.of_type("gcp:projects/iAMMember:IAMMember")
    )
    sa = "serviceAccount:umbra-console@umbra-control.iam.gserviceaccount.com"
    assert grants == [
        (p, r, sa)
        for p in ("acme-umbra", "globex-umbra")
        for r in ("roles/compute.instanceAdmin.v1", "roles/iam.serviceAccountUser")
    ]
    (bucket,) = mocks.of_type("gcp:storage/bucketIAMMember:BucketIAMMember")
    assert (bucket.inputs["bucket"], bucket.inputs["role"]) == (
        "umbra-state",
        "roles/storage.objectAdmin",
    )
    (vm,) = mocks.of_type("gcp:compute/instance:Instance")
    assert vm.inputs["serviceAccount"]["scopes"] == [
        "https://www.googleapis.com/auth/cloud-platform"
    ]


def test_the_database_connection_verifies_the_ca_the_stack_delivers() -> None:
    mocks, exported = _console({})
    (vm,) = mocks.of_type("gcp:compute/instance:Instance")
    assert vm.inputs["metadata"]["umbra-database-ca"] == FAKE_DB_CA
    assert exported["database_ca_pem"] == FAKE_DB_CA
    url = exported["database_url"]
    assert url.endswith(f"?sslmode=verify-full&sslrootcert={DATABASE_CA_PATH}")
    assert DATABASE_CA_PATH.startswith("/run/umbra/launch/")


def test_the_console_exports_its_url_and_ca_for_team_stacks(tmp_path: Any) -> None:
    pem = "-----BEGIN CERTIFICATE-----\nX\n-----END CERTIFICATE-----\n"
    (tmp_path / "console-ca.pem").write_text(pem)
    _, exported = _console(
        {"url": "https://console.umbra.example.com", "tls_ca_file": "console-ca.pem"}, tmp_path
    )
    assert exported["console_url"] == "https://console.umbra.example.com"
    assert exported["console_ca_pem"] == pem


def test_on_azure_the_console_identity_holds_exactly_the_provisioner_roles() -> None:
    raw = _raw("azure")
    doc = json.loads(raw["umbra:stack"]) | {
        "team_resource_groups": ["umbra-globex"],
        "state_scope": "/subscriptions/s/resourceGroups/state/providers/Microsoft.Storage/storageAccounts/umbrastate",
    }
    raw["umbra:stack"] = json.dumps(doc)
    cfg = parse_stack_config(raw, frozenset({"umbra:consoleDbPassword"}))
    assert isinstance(cfg, ConsoleStack)
    mocks, _ = run_program(lambda: build_console(cfg, ROOT), config=raw)
    (vm,) = mocks.of_type("azure-native:compute:VirtualMachine")
    assert vm.inputs["identity"] == {"type": "SystemAssigned"}
    grants = sorted(
        (r.inputs["scope"], r.inputs["roleDefinitionId"].rsplit("/", 1)[1])
        for r in mocks.of_type("azure-native:authorization:RoleAssignment")
    )
    assert grants == [
        (doc["state_scope"], "ba92f5b4-2d11-453d-a403-e96b0029c9fe"),
        (
            "/subscriptions/sub-0000/resourceGroups/umbra-globex",
            "9980e02c-c2be-4d73-94e8-173b1dc7cf3c",
        ),
        # And reads its launch secrets: Key Vault Secrets User on its own vault only.
        ("console-kv-id", "4633458b-17de-408a-b874-0445c86b69e6"),
    ]


def test_the_gcp_console_has_a_reserved_static_address() -> None:
    """Fails before the fix: an ephemeral external address, which any replacement of the Console
    VM (a release) changed, invalidating every team stack's `console_ips`."""
    mocks, exported = _console({})
    (address,) = mocks.of_type("gcp:compute/address:Address")
    assert exported["console_public_ip"] == "198.51.100.7"  # the reserved address
    assert address.inputs["addressType"] == "EXTERNAL"
    assert address.inputs["region"] == "us-central1"
    (vm,) = mocks.of_type("gcp:compute/instance:Instance")
    (access,) = vm.inputs["networkInterfaces"][0]["accessConfigs"]
    assert access["natIp"] == address.outputs["address"]
    # A separate resource: replacing the VM (its metadata changed) does not touch it.
    assert mocks.options[("gcp:compute/address:Address", address.name)].replace_on_changes in (
        None,
        [],
    )


@pytest.mark.parametrize(("cloud", "size"), [("gcp", 250), ("azure", 512)])
def test_the_database_size_is_stack_config(cloud: str, size: int) -> None:
    """Azure's database was fixed at 64 GB: the stack's `db_storage_gb` now sizes it on both."""
    raw = _raw(cloud)
    doc = json.loads(raw["umbra:stack"]) | {"db_storage_gb": size}
    raw["umbra:stack"] = json.dumps(doc)
    cfg = parse_stack_config(raw, frozenset({"umbra:consoleDbPassword"}))
    assert isinstance(cfg, ConsoleStack) and cfg.db_storage_gb == size

    def body() -> Any:
        build_console(cfg, ROOT)
        return None

    mocks, _ = run_program(body, config=raw)
    if cloud == "gcp":
        (db,) = mocks.of_type("gcp:sql/databaseInstance:DatabaseInstance")
        assert db.inputs["settings"]["diskSize"] == size
        assert db.inputs["settings"]["diskAutoresize"] is True  # and a grown disk is kept
    else:
        (db,) = mocks.of_type("azure-native:dbforpostgresql:Server")
        assert db.inputs["storage"]["storageSizeGB"] == size


@pytest.mark.parametrize(
    ("cloud", "size", "problem"),
    [
        ("azure", 100, "not an Azure Flexible Server size"),
        ("gcp", 5, "db_storage_gb"),
        ("gcp", 70000, "db_storage_gb"),
    ],
)
def test_a_database_size_out_of_bounds_is_refused(cloud: str, size: int, problem: str) -> None:
    from umbra.components.config import ConfigError

    raw = _raw(cloud)
    raw["umbra:stack"] = json.dumps(json.loads(raw["umbra:stack"]) | {"db_storage_gb": size})
    with pytest.raises(ConfigError) as err:
        parse_stack_config(raw, frozenset({"umbra:consoleDbPassword"}))
    assert problem in str(err.value) and "umbra:stack" in str(err.value)


def test_the_database_size_defaults_to_64() -> None:
    cfg = parse_stack_config(_raw("azure"), frozenset({"umbra:consoleDbPassword"}))
    assert isinstance(cfg, ConsoleStack) and cfg.db_storage_gb == 64
