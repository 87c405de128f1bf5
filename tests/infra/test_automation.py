"""The Dev CVM provisioner up to the CLI boundary: stack naming, config mapping, the inline
program (run under mocks against a mocked team stack), event relay and output mapping through a
stand-in stack. The real `pulumi` CLI is not installed here."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from pulumi import automation as auto

from tests.infra.harness import run_program
from umbra.components.automation import (
    DevCvmSpec,
    EventKind,
    ProvisionerError,
    ProvisionEvent,
    PulumiDevCvmProvisioner,
    TeamTarget,
)
from umbra.components.config import AzurePlacement, GcpPlacement
from umbra.components.naming import Owner, dev_cvm_name

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KEY = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA+HjuKwAGfMBVi2qWrDrClbo2C0c2CXLVGvPI/rAw8V alice@laptop"
)
APP_COMPOSE = '{"docker_compose_file":"services: {}\\n","manifest_version":2,"name":"dev","runner":"docker-compose"}'
GCP = TeamTarget(
    team="acme",
    cloud="gcp",
    team_stack="acme-org/umbra/acme-gcp",
    gcp=GcpPlacement(project="acme-umbra", region="us-central1", zone="us-central1-a"),
)
AZURE = TeamTarget(
    team="globex",
    cloud="azure",
    team_stack="globex-org/umbra/globex-azure",
    azure=AzurePlacement(location="westeurope", zone="1"),
)


def spec(**kw: Any) -> DevCvmSpec:
    base: dict[str, Any] = dict(
        developer="alice",
        cvm="main",
        ssh_authorized_keys=(KEY,),
        size="c3-standard-8",
        image="projects/umbra/global/images/dev-cvm-2025-07",
        app_compose=APP_COMPOSE,
        cvm_id="cvm-0193",
        measurement_manifest="sha256:" + "ab" * 32,
    )
    return DevCvmSpec(**(base | kw))


def test_stack_name_and_config_mapping() -> None:
    gcp = PulumiDevCvmProvisioner(GCP)
    assert gcp.stack_name(spec()) == "acme-alice-main"
    assert PulumiDevCvmProvisioner(GCP, org="acme-org").stack_name(spec(cvm="scratch")) == (
        "acme-org/umbra-dev-cvm/acme-alice-scratch"
    )
    cfg = {k: v.value for k, v in gcp.stack_config(spec()).items()}
    # The whole request rides in the stack's config, so stop/start needs only the stack ref.
    request = json.loads(cfg.pop("umbra:devCvm"))
    assert request["target"]["team_stack"] == "acme-org/umbra/acme-gcp"
    assert request["spec"]["ssh_authorized_keys"] == [KEY]
    assert DevCvmSpec(**request["spec"]) == spec()
    assert cfg.pop("umbra:running") == "true"
    assert cfg == {
        "umbra:team": "acme",
        "umbra:developer": "alice",
        "umbra:cvm": "main",
        "gcp:project": "acme-umbra",
        "gcp:region": "us-central1",
        "gcp:zone": "us-central1-a",
    }
    az = {k: v.value for k, v in PulumiDevCvmProvisioner(AZURE).stack_config(spec()).items()}
    assert az["azure-native:location"] == "westeurope" and "gcp:project" not in az


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"developer": "Alice"}, "developer 'Alice' is not a valid name"),
        ({"ssh_authorized_keys": ()}, "developer 'alice' has no SSH keys"),
        (
            {"ssh_authorized_keys": ("not-a-key",)},
            "ssh_authorized_keys: not an OpenSSH public key line",
        ),
        ({"app_compose": "services: {}"}, "app_compose is not an app-compose.json document"),
    ],
)
def test_bad_specs_are_refused_before_any_run(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ProvisionerError, match=message):
        spec(**kw)


def test_inline_program_builds_a_tdx_dev_cvm_on_the_team_network() -> None:
    team_outputs = {
        "dev_subnet_id": "projects/acme-umbra/regions/us-central1/subnetworks/umbra-acme-dev",
        "dev_identity": "umbra-acme-dev@acme-umbra.iam.gserviceaccount.com",
        "security_cvm_ip": "10.20.1.10",
        "console_url": "https://console.acme.example",
        "console_ca_pem": "",
        "console_ips": ["198.51.100.7"],
    }
    program = PulumiDevCvmProvisioner(GCP).program(spec())
    mocks, _ = run_program(program, stack_outputs=team_outputs)
    (ref,) = mocks.of_type("pulumi:pulumi:StackReference")
    assert ref.name == "acme-org/umbra/acme-gcp"
    (vm,) = mocks.of_type("gcp:compute/instance:Instance")
    p = vm.inputs
    assert p["name"] == dev_cvm_name("acme", "alice", "main", Owner.CONSOLE)
    assert p["confidentialInstanceConfig"]["confidentialInstanceType"] == "TDX"
    assert p["networkInterfaces"] == [{"subnetwork": team_outputs["dev_subnet_id"]}]
    assert "10.20.1.10" in p["metadata"]["umbra-host-firewall"]
    # What the forwarder's enrollment needs: the Console by URL and address, admitted on 443.
    assert p["metadata"]["umbra-console-url"] == "https://console.acme.example"
    assert p["metadata"]["umbra-console-ips"] == "198.51.100.7"
    assert "umbra-console-ca" not in p["metadata"]
    assert "ip daddr { 198.51.100.7 } tcp dport 443" in p["metadata"]["umbra-host-firewall"]
    assert p["serviceAccount"]["email"] == team_outputs["dev_identity"]
    assert p["metadata"]["umbra-measurement-manifest"] == "sha256:" + "ab" * 32
    assert p["metadata"]["umbra-app-compose"] == APP_COMPOSE
    assert p["metadata"]["umbra-cvm-id"] == "cvm-0193"
    assert p["labels"]["umbra-role"] == "dev-cvm"


def test_inline_program_on_azure_uses_the_team_resource_group() -> None:
    outputs = {
        "dev_subnet_id": "/subscriptions/s/.../subnets/dev",
        "resource_group_name": "umbra-globex",
        "security_cvm_ip": "10.30.1.10",
        "console_url": "https://console.globex.example",
    }
    program = PulumiDevCvmProvisioner(AZURE).program(
        spec(size="Standard_DC4es_v5", image="Canonical:ubuntu-24_04-lts:cvm:latest")
    )
    mocks, _ = run_program(program, stack_outputs=outputs)
    (vm,) = mocks.of_type("azure-native:compute:VirtualMachine")
    assert vm.inputs["resourceGroupName"] == "umbra-globex"
    assert vm.inputs["securityProfile"]["securityType"] == "ConfidentialVM"
    (nic,) = mocks.of_type("azure-native:network:NetworkInterface")
    assert "publicIPAddress" not in nic.inputs["ipConfigurations"][0]


def _event(seq: int, **kw: Any) -> auto.EngineEvent:
    return auto.EngineEvent(sequence=seq, timestamp=0, **kw)


def _step(op: auto.OpType, typ: str) -> auto.StepEventMetadata:
    return auto.StepEventMetadata(op=op, urn=f"urn:pulumi:s::p::{typ}::x", type=typ, provider="")


class FakeStack:
    def __init__(self, events: list[auto.EngineEvent], fail: Exception | None = None) -> None:
        self.events, self.fail = events, fail
        self.config: Mapping[str, auto.ConfigValue] = {}
        self.calls: list[str] = []

    def set_all_config(self, config: MutableMapping[str, auto.ConfigValue]) -> None:
        self.config = dict(config)

    def _emit(self, on_event: Callable[[auto.EngineEvent], None]) -> None:
        for e in self.events:
            on_event(e)
        if self.fail:
            raise self.fail

    def up(self, *, on_event: Callable[[auto.EngineEvent], None]) -> Any:
        self.calls.append("up")
        self._emit(on_event)
        out = {
            "instance_id": "123",
            "private_ip": "10.20.0.7",
            "compose_sha256": "c" * 64,
            "ssh_keys_sha256": "d" * 64,
            "expected_events": {"compose-hash": "c" * 64},
        }
        return auto.UpResult("", "", None, {k: auto.OutputValue(v, False) for k, v in out.items()})  # type: ignore[arg-type]

    def destroy(self, *, on_event: Callable[[auto.EngineEvent], None], remove: bool = False) -> Any:
        self.calls.append(f"destroy remove={remove}")
        self._emit(on_event)


def test_launch_update_destroy_relay_progress_and_outputs() -> None:
    events = [
        _event(
            1,
            resource_pre_event=auto.ResourcePreEvent(
                _step(auto.OpType.CREATE, "gcp:compute/instance:Instance")
            ),
        ),
        _event(2, stdout_event=auto.StdoutEngineEvent("noise", "")),
        _event(3, diagnostic_event=auto.DiagnosticEvent("quota is low\n", "", "warning")),
        _event(
            4,
            res_outputs_event=auto.ResOutputsEvent(
                _step(auto.OpType.CREATE, "gcp:compute/instance:Instance")
            ),
        ),
    ]
    stack = FakeStack(events)
    made: list[tuple[str, bool]] = []

    def factory(name: str, program: Any, create: bool) -> FakeStack:
        made.append((name, create))
        return stack

    prov = PulumiDevCvmProvisioner(GCP, stack_factory=factory)
    seen: list[ProvisionEvent] = []
    out = prov.launch(spec(), seen.append)
    assert out.private_ip == "10.20.0.7" and out.stack == "acme-alice-main"
    assert out.expected_events == {"compose-hash": "c" * 64}
    assert [(e.kind, e.message) for e in seen] == [
        ("started", "launch acme-alice-main"),
        ("resource", "create gcp:compute/instance:Instance"),
        ("diagnostic", "quota is low"),
        ("resource", "done create gcp:compute/instance:Instance"),
        ("finished", "acme-alice-main is up"),
    ]
    assert all(isinstance(e.kind, EventKind) for e in seen)
    assert stack.config["gcp:zone"].value == "us-central1-a"
    prov.update(spec(), lambda e: None)
    prov.destroy(spec(), lambda e: None)
    assert made == [
        ("acme-alice-main", True),
        ("acme-alice-main", False),
        ("acme-alice-main", False),
    ]
    assert stack.calls == ["up", "up", "destroy remove=True"]


def test_a_failed_run_reports_failed_and_raises() -> None:
    failing = FakeStack([], fail=RuntimeError("error: quota exceeded\nC3 CPUS limit 0"))
    prov = PulumiDevCvmProvisioner(GCP, stack_factory=lambda n, p, c: failing)
    seen: list[ProvisionEvent] = []
    # The whole text, error lines first: the cause is rarely on Pulumi's last line.
    with pytest.raises(
        ProvisionerError, match=r"^acme-alice-main: error: quota exceeded \| C3 CPUS limit 0$"
    ):
        prov.launch(spec(), seen.append)
    assert [e.kind for e in seen] == ["started", "failed"]


@pytest.mark.skipif(shutil.which("pulumi") is not None, reason="a Pulumi CLI is installed here")
def test_without_the_cli_the_default_stack_factory_fails_clearly() -> None:
    with pytest.raises(ProvisionerError, match="the Pulumi CLI is not installed on this host"):
        PulumiDevCvmProvisioner(GCP).launch(spec(), lambda e: None)


@pytest.mark.skipif(shutil.which("pulumi") is not None, reason="a Pulumi CLI is installed here")
def test_runs_reuse_one_private_workspace_per_stack_and_leave_no_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    prov = PulumiDevCvmProvisioner(GCP)
    for _ in range(2):
        with pytest.raises(ProvisionerError):
            prov.launch(spec(), lambda e: None)
    (root,) = scratch.iterdir()  # the workspaces' root, nothing else (no `automation-*`)
    assert root.name == f"umbra-pulumi-{os.getuid()}"
    assert [p.name for p in root.iterdir()] == ["acme-alice-main"]
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_a_workspace_root_others_can_write_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir(mode=0o777)
    root.chmod(0o777)
    with pytest.raises(ProvisionerError, match=r"must be a directory owned by uid .* mode 0700"):
        PulumiDevCvmProvisioner(GCP, work_root=root).work_dir("acme-alice-main")


def test_the_package_keeps_one_concern_a_module() -> None:
    from umbra.components import automation

    package = Path(automation.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in package.glob("*.py")}
    assert max(sizes.values()) < 300, sizes
    assert all(hasattr(automation, name) for name in automation.__all__)
