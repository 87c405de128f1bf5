"""Provisioner robustness against a fake engine (the `pulumi` CLI is not installed here): plugins
installed for inline programs, refresh before every up, the policy pack on every up, a crashed
run's lock cancelled and its pending operations cleared, transient errors retried with backoff,
final errors reported whole, and stop/start from the stack ref alone."""

from __future__ import annotations

import json
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from pulumi import automation as auto

from tests.infra.harness import run_program
from tests.infra.test_automation import GCP, spec
from umbra.components.automation import (
    DEV_CVM_KEY,
    POLICY_PACK,
    ProvisionerError,
    ProvisionEvent,
    PulumiDevCvmProvisioner,
    RobustStack,
    config_program,
    error_text,
    installed_plugins,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

OUTPUTS = {
    "instance_id": "123",
    "private_ip": "10.20.0.7",
    "compose_sha256": "c" * 64,
    "ssh_keys_sha256": "d" * 64,
    "expected_events": {"compose-hash": "c" * 64},
}
PENDING = [
    {"type": "creating", "resource": {"urn": "urn:pulumi:s::p::gcp:compute/instance:Instance::x"}}
]


class FakeWorkspace:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def install_plugin(self, name: str, version: str, kind: str = "resource") -> None:
        self.calls.append(f"plugin {name} {version}")


class FakeEngine:
    """What `pulumi.automation.Stack` does, as far as RobustStack can tell."""

    def __init__(self, up_failures: list[Exception] | None = None, pending: bool = False) -> None:
        self.calls: list[str] = []
        self._workspace = FakeWorkspace(self.calls)
        self.up_failures = list(up_failures or [])
        self.state: dict[str, Any] = {
            "resources": [],
            "pending_operations": PENDING if pending else [],
        }
        self.locked = False
        self.config: dict[str, str] = {}

    @property
    def workspace(self) -> FakeWorkspace:
        return self._workspace

    def set_all_config(self, config: MutableMapping[str, auto.ConfigValue]) -> None:
        self.config |= {k: v.value for k, v in config.items()}

    def up(
        self, *, on_event: Callable[[auto.EngineEvent], None], policy_packs: list[str] | None = None
    ) -> Any:
        self.calls.append(f"up policy_packs={policy_packs}")
        if self.locked:
            raise auto.ConcurrentUpdateError(auto.CommandResult("", "the stack is locked", 255))
        if self.state["pending_operations"]:
            raise auto.CommandError(auto.CommandResult("", "pending operations", 255))
        if self.up_failures:
            raise self.up_failures.pop(0)
        return auto.UpResult(
            "", "", None, {k: auto.OutputValue(v, False) for k, v in OUTPUTS.items()}
        )  # type: ignore[arg-type]

    def refresh(self, *, on_event: Callable[[auto.EngineEvent], None]) -> Any:
        self.calls.append("refresh")
        if self.locked:
            raise auto.ConcurrentUpdateError(auto.CommandResult("", "the stack is locked", 255))

    def destroy(self, *, on_event: Callable[[auto.EngineEvent], None], remove: bool = False) -> Any:
        self.calls.append(f"destroy remove={remove}")

    def cancel(self) -> None:
        self.calls.append("cancel")
        if not self.locked:
            raise auto.CommandError(auto.CommandResult("", "no update in progress", 255))
        self.locked = False

    def export_stack(self) -> auto.Deployment:
        return auto.Deployment(version=3, deployment=json.loads(json.dumps(self.state)))

    def import_stack(self, state: auto.Deployment) -> None:
        self.calls.append("import")
        self.state = dict(state.deployment or {})


def provisioner(engine: FakeEngine, notices: list[str], **kw: Any) -> PulumiDevCvmProvisioner:
    def factory(name: str, program: Any, create: bool) -> RobustStack:
        return RobustStack(
            engine,
            policy_packs=[str(POLICY_PACK)],
            plugins={"gcp": "9.10.0"},
            on_notice=notices.append,
        )

    return PulumiDevCvmProvisioner(GCP, stack_factory=factory, sleep=lambda s: None, **kw)


def test_a_clean_launch_installs_plugins_refreshes_and_runs_the_policy_pack() -> None:
    engine, notices = FakeEngine(), []
    provisioner(engine, notices).launch(spec(), lambda e: None)
    assert engine.calls == ["plugin gcp 9.10.0", "refresh", f"up policy_packs={[str(POLICY_PACK)]}"]
    assert (POLICY_PACK / "PulumiPolicy.yaml").is_file()
    assert notices == []


def test_after_a_crash_the_lock_is_cancelled_and_pending_operations_are_cleared() -> None:
    engine, notices = FakeEngine(pending=True), []
    engine.locked = True
    out = provisioner(engine, notices).launch(spec(), lambda e: None)
    assert out.private_ip == "10.20.0.7"
    assert engine.state["pending_operations"] == []
    assert "cancel" in engine.calls and "import" in engine.calls
    assert engine.calls[-2:] == ["refresh", f"up policy_packs={[str(POLICY_PACK)]}"]
    assert any("cleared pending creating" in n and "check for orphans" in n for n in notices)


def test_transient_errors_are_retried_with_backoff_and_final_ones_are_not() -> None:
    engine = FakeEngine(
        up_failures=[
            RuntimeError("error: googleapi: Error 503: backend unavailable"),
            RuntimeError("error: rateLimitExceeded"),
        ]
    )
    slept: list[float] = []
    seen: list[ProvisionEvent] = []
    prov = PulumiDevCvmProvisioner(
        GCP,
        stack_factory=lambda n, p, c: RobustStack(engine, policy_packs=["pack"], plugins={}),
        sleep=slept.append,
        backoff_s=2.0,
    )
    prov.launch(spec(), seen.append)
    assert slept == [2.0, 4.0]
    assert [e.kind for e in seen].count("diagnostic") == 2
    quota = FakeEngine(up_failures=[RuntimeError("error: Quota 'C3_CPUS' exceeded. Limit: 0")])
    slept.clear()
    prov = PulumiDevCvmProvisioner(
        GCP,
        stack_factory=lambda n, p, c: RobustStack(quota, policy_packs=["pack"], plugins={}),
        sleep=slept.append,
    )
    with pytest.raises(ProvisionerError, match="Quota 'C3_CPUS' exceeded"):
        prov.launch(spec(), lambda e: None)
    assert slept == []


def test_the_failure_reason_is_the_whole_error_with_error_lines_first() -> None:
    text = (
        "Updating (acme-alice-main):\n"
        "  gcp:compute:Instance x creating failed\n"
        "error: 1 error occurred:\n"
        "\t* Error creating instance: googleapi: Error 400: Invalid value for field "
        "'resource.machineType': 'c3-standard-3'\n"
        "Resources:\n    1 unchanged\n"
    )
    reason = error_text(RuntimeError(text))
    assert reason.startswith("error: 1 error occurred: | * Error creating instance")
    assert "c3-standard-3" in reason and "1 unchanged" in reason


def test_without_a_policy_pack_nothing_runs() -> None:
    with pytest.raises(ProvisionerError, match="policy pack"):
        PulumiDevCvmProvisioner(GCP, policy_packs=())


def test_installed_plugins_match_the_provider_sdks() -> None:
    plugins = installed_plugins()
    assert set(plugins) == {"gcp", "azure-native"}
    assert all(v[0].isdigit() for v in plugins.values())


def test_stop_and_start_rerun_the_stack_from_its_own_config() -> None:
    engine, notices = FakeEngine(), []
    prov = provisioner(engine, notices)
    prov.launch(spec(), lambda e: None)
    request = engine.config[DEV_CVM_KEY]
    seen: list[ProvisionEvent] = []
    prov.set_running("acme-alice-main", False, seen.append)
    assert engine.config["umbra:running"] == "false"
    assert engine.config[DEV_CVM_KEY] == request  # same request, same launch data
    assert [e.kind for e in seen] == ["started", "finished"]
    # The program the stop runs: the same Dev CVM, stopped (GCP: TERMINATED), disk kept.
    mocks, _ = run_program(
        config_program,
        {"dev_subnet_id": "s", "dev_identity": "d@x", "security_cvm_ip": "10.20.1.10"},
        config=engine.config,
    )
    (vm,) = mocks.of_type("gcp:compute/instance:Instance")
    assert vm.inputs["desiredStatus"] == "TERMINATED"
    assert len(mocks.of_type("gcp:compute/disk:Disk")) == 1


def test_stopping_on_azure_removes_the_vm_and_keeps_disk_and_nic() -> None:
    from tests.infra.test_automation import AZURE

    prov = PulumiDevCvmProvisioner(AZURE)
    az = spec(size="Standard_DC4es_v5", image="Canonical:ubuntu-24_04-lts:cvm:latest")
    config = {k: v.value for k, v in prov.stack_config(az, running=False).items()}
    outputs = {"dev_subnet_id": "sub", "resource_group_name": "rg", "security_cvm_ip": "10.30.1.10"}
    mocks, _ = run_program(config_program, outputs, config=config)
    assert mocks.of_type("azure-native:compute:VirtualMachine") == []
    assert len(mocks.of_type("azure-native:compute:Disk")) == 1
    assert len(mocks.of_type("azure-native:network:NetworkInterface")) == 1


BACKEND = "gs://umbra-control-umbra-console-state"
KMS = (
    "gcpkms://projects/umbra-control/locations/us-central1/keyRings/umbra-console/"
    "cryptoKeys/dev-cvm-stacks"
)


def test_every_dev_cvm_stack_uses_the_declared_backend_and_secrets_provider(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before, the workspace named neither: each replica's `pulumi` used its own login and the
    passphrase provider. Captured at the Automation API boundary (no CLI here)."""
    from pulumi import automation as auto

    seen: dict[str, Any] = {}

    def fake(name: str, project_name: str, program: Any, opts: auto.LocalWorkspaceOptions) -> Any:
        seen.update(name=name, opts=opts)
        return object()

    monkeypatch.setattr(auto, "create_or_select_stack", fake)
    prov = PulumiDevCvmProvisioner(
        GCP, backend_url=BACKEND, secrets_provider=KMS, work_root=tmp_path / "w"
    )
    prov._local_stack("acme-alice-box", lambda: None, create=True)
    opts = seen["opts"]
    assert opts.secrets_provider == KMS
    assert opts.project_settings.backend.url == BACKEND
    assert opts.project_settings.name == "umbra-dev-cvm"


@pytest.mark.parametrize(
    ("backend", "provider", "problem"),
    [
        (BACKEND, None, "come together"),
        (None, KMS, "come together"),
        ("file:///tmp/state", KMS, "not gs://"),
        (BACKEND, "passphrase", "not gcpkms://"),
    ],
)
def test_a_backend_without_a_kms_secrets_provider_is_refused(
    backend: str | None, provider: str | None, problem: str
) -> None:
    with pytest.raises(ProvisionerError, match=problem):
        PulumiDevCvmProvisioner(GCP, backend_url=backend, secrets_provider=provider)
