"""ConsoleService under mocks on both clouds: the Console's VM is a TDX CVM, PostgreSQL has no
public address, the password only travels as a secret, and the policy pack accepts it all."""

from __future__ import annotations

import copy
import json
from typing import Any

import pulumi
import pytest

from tests.infra.harness import ROOT, example_raw, example_stack, run_program
from tests.infra.test_policy_pack import violations
from umbra.components.config import ConsoleStack, parse_stack_config
from umbra.components.console_service import ConsoleService
from umbra.components.program import build_console

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PASSWORD = "a-very-secret-db-password"


def _raw(cloud: str) -> dict[str, str]:
    raw = example_raw("console-gcp")
    if cloud == "azure":
        doc = copy.deepcopy(example_stack("console-gcp"))
        del doc["gcp"]
        doc |= {
            "cloud": "azure",
            "azure": {"location": "westeurope"},
            "db_tier": "Standard_D2ds_v5",
        }
        doc["vm"] |= {"size": "Standard_DC4es_v5", "image": "Canonical:ubuntu-24_04-lts:cvm:latest"}
        raw = {"umbra:stack": json.dumps(doc)}
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
    # The password reaches the database resource and nothing else in clear.
    holders = [r for r in mocks.resources if PASSWORD in json.dumps(r.inputs)]
    assert {r.typ for r in holders} <= {
        "gcp:sql/user:User",
        "azure-native:dbforpostgresql:Server",
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
