"""The `gcp` and `azure` provider adapters on the Pulumi provisioner, through the Console's HTTP
API: launches run outside the request's transaction, progress and outcome land on the record,
failures end in `failed` with a one-line reason and nothing half-recorded. The Pulumi CLI is
replaced by `FakeClouds` behind the provisioner's `stack_factory`."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.console.conftest import BACKENDS, new_database
from tests.console.fake_pulumi import FakeClouds
from tests.console.helpers import Server, Team, new_team, start_server, unique
from tests.console.oidc_issuer import LocalIssuer
from umbra.console.config import ConfigError, settings_from_env
from umbra.console.providers_pulumi import developer_slug
from umbra.policy.bundle import generate_key

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KEY = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA+HjuKwAGfMBVi2qWrDrClbo2C0c2CXLVGvPI/rAw8V alice@laptop"
)
KEY2 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBbbHjuKwAGfMBVi2qWrDrClbo2C0c2CXLVGvPI/rAw8 alice@desk"
APP_COMPOSE = {"docker_compose_file": "services: {}\n", "manifest_version": 2, "name": "dev"}


def gcp_settings(compose: Path, team: str) -> dict[str, Any]:
    return {
        "org": "acme-org",
        "image": "projects/umbra/global/images/dev-cvm-2026-12",
        "app_compose": str(compose),
        "measurement_manifest": "sha256:" + "ab" * 32,
        "teams": {
            team: {
                "team_stack": "acme-org/umbra/acme-gcp",
                "project": "acme-umbra",
                "region": "us-central1",
                "zone": "us-central1-a",
            }
        },
    }


def azure_settings(compose: Path, team: str) -> dict[str, Any]:
    return {
        "image": "Canonical:ubuntu-24_04-lts:cvm:latest",
        "app_compose": str(compose),
        "subscription_id": str(uuid.uuid4()),
        "teams": {team: {"team_stack": "globex/umbra/globex-azure", "location": "westeurope"}},
    }


@dataclass
class Cloud:
    server: Server
    clouds: FakeClouds
    gcp: Team
    azure: Team
    other: Team  # a team with no cloud target


@pytest.fixture(scope="module", params=BACKENDS)
def cloud(
    request: pytest.FixtureRequest, issuer: LocalIssuer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cloud]:
    from umbra.console.config import AzureProvider, GcpProvider

    tmp = tmp_path_factory.mktemp(f"cloud-{request.param}")
    compose = tmp / "app-compose.json"
    compose.write_text(json.dumps(APP_COMPOSE))
    gcp_team, azure_team = "g" + uuid.uuid4().hex[:8], "a" + uuid.uuid4().hex[:8]
    url, sqlite_path = new_database(request.param, request)
    clouds = FakeClouds()
    server = start_server(
        request.param,
        url,
        sqlite_path,
        issuer.url,
        generate_key(),
        tmp,
        stack_factory=clouds.factory,
        providers=["local", "gcp", "azure"],
        gcp=GcpProvider.model_validate(gcp_settings(compose, gcp_team)),
        azure=AzureProvider.model_validate(azure_settings(compose, azure_team)),
    )
    teams = [new_team(server, issuer, name) for name in (gcp_team, azure_team, None)]
    yield Cloud(server, clouds, *teams)
    for team in teams:
        team.close()
    server.stop()


def launch(team: Team, provider: str, name: str | None = None, **body: Any) -> httpx.Response:
    payload = {"name": name or unique("c")[:10], "provider": provider, "ssh_keys": [KEY]} | body
    return team.dev.post(f"/api/v1/teams/{team.name}/cvms", json=payload)


def settle(team: Team, cvm_id: str, timeout: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        cvm: dict[str, Any] = team.admin.get(f"/api/v1/cvms/{cvm_id}").json()
        if cvm["state"] not in ("launching", "updating", "destroying"):
            return cvm
        assert time.monotonic() < deadline, f"CVM stayed {cvm['state']}"
        time.sleep(0.05)


def audit_actions(team: Team, cvm_id: str) -> list[tuple[str, dict[str, Any]]]:
    entries = team.admin.get(f"/api/v1/teams/{team.name}/audit?limit=1000").json()["entries"]
    return [(e["action"], e["details"]) for e in entries if e["target"] == cvm_id]


def test_provider_launch_runs_outside_the_transaction(cloud: Cloud) -> None:
    team, name = cloud.gcp, "held"
    gate = cloud.clouds.gates[f"-{name}"] = threading.Event()
    response = launch(team, "gcp", name)
    assert response.status_code == 201, response.text
    cvm = response.json()
    assert cvm["state"] == "launching" and cvm["provider_ref"] is None
    # While the cloud run is held, writes go through: no transaction (nor SQLite write gate) is held.
    started = time.monotonic()
    local = team.dev.post(f"/api/v1/teams/{team.name}/cvms", json={"name": unique("l")})
    assert local.status_code == 201 and local.json()["state"] == "running"
    assert team.upload(1).status_code == 201
    assert time.monotonic() - started < 5
    during = team.dev.get(f"/api/v1/cvms/{cvm['id']}").json()
    assert during["state"] == "launching"
    assert any(e["kind"] == "started" for e in during["events"])
    blocked = team.dev.delete(f"/api/v1/cvms/{cvm['id']}")
    assert blocked.status_code == 409 and "launching" in blocked.json()["detail"]
    gate.set()
    done = settle(team, cvm["id"])
    developer = team.dev_subject
    stack = f"acme-org/umbra-dev-cvm/{team.name}-{developer}-{name}"
    assert done["state"] == "running" and done["state_reason"] is None
    assert done["provider_ref"] == stack
    state = done["provider_state"]
    assert state["stack"] == stack and state["instance_id"] == f"{stack}-vm"
    assert state["private_ip"].startswith("10.20.0.")
    assert state["expected_events"] == {"compose-hash": "c" * 64}
    kinds = [e["kind"] for e in done["events"]]
    assert kinds[0] == "started" and kinds[-1] == "finished" and "diagnostic" in kinds
    config = cloud.clouds.stacks[stack].config
    assert config["gcp:project"] == "acme-umbra" and config["umbra:cvm"] == name
    # Launch data: a one-time enrollment token, kept as a Pulumi secret, never a credential.
    key = "umbra:devCvm"
    token = json.loads(config[key])["spec"]["enrollment_token"]
    assert token.startswith("enr_") and key in cloud.clouds.stacks[stack].secret_keys
    assert token not in response.text and token not in str(done)
    actions = audit_actions(team, cvm["id"])
    assert [a for a, _ in actions] == ["cvm.launch", "cvm.enrollment_token", "cvm.provisioned"]
    assert actions[2][1] == {"operation": "launch", "state": "running"}


def test_provider_failure_leaves_no_half_state(cloud: Cloud) -> None:
    team, name = cloud.gcp, "broken"
    cloud.clouds.fail_up[f"-{name}"] = (
        "error: update failed\n  gcp:compute:Instance: QUOTA_EXCEEDED: C3_CPUS in us-central1"
    )
    response = launch(team, "gcp", name)
    assert response.status_code == 201
    failed = settle(team, response.json()["id"])
    assert failed["state"] == "failed"
    reason = failed["state_reason"]
    assert "\n" not in reason and reason.startswith("launch: ")
    assert reason.endswith("QUOTA_EXCEEDED: C3_CPUS in us-central1")
    # Nothing of the half-finished run is recorded as if it were the CVM.
    assert failed["provider_ref"] is None and failed["provider_state"] == {}
    assert failed["events"][-1]["kind"] == "failed"
    actions = audit_actions(team, failed["id"])
    assert actions[-1] == (
        "cvm.provisioned",
        {"operation": "launch", "state": "failed", "reason": reason},
    )
    patch = team.dev.patch(f"/api/v1/cvms/{failed['id']}", json={"state": "stopped"})
    assert patch.status_code == 409
    # Destroying cleans up whatever the failed run created in the cloud.
    gone = team.dev.delete(f"/api/v1/cvms/{failed['id']}")
    assert gone.status_code == 200 and gone.json()["state"] == "destroying"
    final = settle(team, failed["id"])
    assert final["state"] == "destroyed" and final["state_reason"] is None
    assert not any(name in stack for stack in cloud.clouds.stacks)


def test_provider_failure_before_any_stack_destroys_cleanly(cloud: Cloud) -> None:
    team, name = cloud.gcp, "nocli"
    cloud.clouds.no_cli.add(f"-{name}")
    failed = settle(team, launch(team, "gcp", name).json()["id"])
    assert failed["state"] == "failed"
    assert "the Pulumi CLI is not installed" in failed["state_reason"]
    # No stack was ever created, so destroying has nothing to remove and succeeds.
    assert team.dev.delete(f"/api/v1/cvms/{failed['id']}").status_code == 200
    done = settle(team, failed["id"])
    assert done["state"] == "destroyed" and done["events"][-1]["message"] == "no stack to destroy"


def test_provider_refusals_are_precise_4xx(cloud: Cloud) -> None:
    team = cloud.gcp
    no_keys = launch(team, "gcp", ssh_keys=[])
    assert no_keys.status_code == 422 and "has no SSH keys" in no_keys.json()["detail"]
    bad_key = launch(team, "gcp", ssh_keys=["not-a-key"])
    assert bad_key.status_code == 422 and bad_key.json()["detail"][0]["loc"][-2] == "ssh_keys"
    long_name = launch(team, "gcp", "a-name-far-too-long-for-a-stack")
    assert long_name.status_code == 422 and "not a valid name" in long_name.json()["detail"]
    security = team.admin.post(
        f"/api/v1/teams/{team.name}/cvms",
        json={"name": "sec2", "kind": "security", "provider": "gcp"},
    )
    assert security.status_code == 422 and "Security CVM" in security.json()["detail"]
    other = launch(cloud.other, "gcp")
    assert other.status_code == 422 and "has no gcp team stack" in other.json()["detail"]
    # Nothing was stored for the refusals.
    names = [c["name"] for c in team.admin.get(f"/api/v1/teams/{team.name}/cvms").json()]
    assert "a-name-far-too-long-for-a-stack" not in names and "sec2" not in names


def test_provider_stop_start_run_in_the_worker_with_team_defaults(cloud: Cloud) -> None:
    """Cloud stop/start run in the provisioning worker, not the request; a cloud launch gets the
    team's default profiles like a local one."""
    team, name = cloud.gcp, "stp"
    serials = [b["serial"] for b in team.admin.get(f"/api/v1/teams/{team.name}/bundles").json()]
    assert team.upload(max(serials, default=0) + 1).status_code == 201
    defaults = f"/api/v1/teams/{team.name}/default-profiles"
    assert team.admin.put(defaults, json={"profiles": ["github"]}).status_code == 200
    launched = launch(team, "gcp", name).json()
    assert (launched["state"], launched["profiles"]) == ("launching", ["github"])
    running = settle(team, launched["id"])
    assert running["profiles"] == ["github"]
    stack = running["provider_ref"]

    gate = cloud.clouds.gates[f"-{name}"] = threading.Event()
    try:
        started = time.monotonic()
        stop = team.dev.patch(f"/api/v1/cvms/{running['id']}", json={"state": "stopped"})
        # Answered while the provider run is held: the run is not inside the request.
        assert stop.status_code == 200 and stop.json()["state"] == "updating", stop.text
        assert time.monotonic() - started < 5
        busy = team.dev.patch(f"/api/v1/cvms/{running['id']}", json={"state": "running"})
        assert busy.status_code == 409
    finally:
        gate.set()
        del cloud.clouds.gates[f"-{name}"]
    stopped = settle(team, running["id"])
    assert (stopped["state"], stopped["state_reason"]) == ("stopped", None)
    # Cloud CVMs stop and start through the provisioner (docs/specs/infra.md, stop/start).
    assert cloud.clouds.stacks[stack].config["umbra:running"] == "false"
    start = team.dev.patch(f"/api/v1/cvms/{running['id']}", json={"state": "running"})
    assert start.status_code == 200 and start.json()["state"] == "updating"
    assert settle(team, running["id"])["state"] == "running"
    assert cloud.clouds.stacks[stack].config["umbra:running"] == "true"
    operations = [
        d.get("operation") for a, d in audit_actions(team, running["id"]) if a == "cvm.provisioned"
    ]
    assert operations == ["launch", "stop", "start"]
    assert team.admin.put(defaults, json={"profiles": []}).status_code == 200


def test_provider_update_and_destroy(cloud: Cloud) -> None:
    team, name = cloud.gcp, "upd"
    cvm = settle(team, launch(team, "gcp", name).json()["id"])
    first = cvm["provider_state"]["ssh_keys_sha256"]
    updating = team.dev.patch(
        f"/api/v1/cvms/{cvm['id']}", json={"ssh_keys": [KEY, KEY2], "size": "c3-standard-8"}
    )
    assert updating.status_code == 200 and updating.json()["state"] == "updating"
    updated = settle(team, cvm["id"])
    assert updated["state"] == "running" and updated["size"] == "c3-standard-8"
    assert updated["ssh_keys"] == [KEY, KEY2]
    assert updated["provider_state"]["ssh_keys_sha256"] != first
    cloud.clouds.fail_destroy[f"-{name}"] = "error: resource is in use"
    assert team.dev.delete(f"/api/v1/cvms/{cvm['id']}").status_code == 200
    failed = settle(team, cvm["id"])
    assert failed["state"] == "failed" and failed["state_reason"].endswith("resource is in use")
    assert failed["profiles"] == []
    del cloud.clouds.fail_destroy[f"-{name}"]
    assert team.dev.delete(f"/api/v1/cvms/{cvm['id']}").status_code == 200
    assert settle(team, cvm["id"])["state"] == "destroyed"
    operations = [
        d.get("operation") for a, d in audit_actions(team, cvm["id"]) if a == "cvm.provisioned"
    ]
    assert operations == ["launch", "update", "destroy", "destroy"]


def test_provider_azure_launch_and_owner_slug(cloud: Cloud) -> None:
    team = cloud.azure
    response = team.admin.post(
        f"/api/v1/teams/{team.name}/cvms",
        json={"name": "box", "provider": "azure", "owner": "Alice@Example.com", "ssh_keys": [KEY]},
    )
    assert response.status_code == 201, response.text
    done = settle(team, response.json()["id"])
    slug = developer_slug("Alice@Example.com")
    assert slug.startswith("u") and len(slug) == 16
    assert done["state"] == "running" and done["provider_ref"] == f"{team.name}-{slug}-box"
    assert cloud.clouds.stacks[done["provider_ref"]].config["azure-native:location"] == "westeurope"


def test_provider_settings_are_strict(tmp_path: Path) -> None:
    compose = tmp_path / "app-compose.json"
    compose.write_text(json.dumps(APP_COMPOSE))
    good = json.dumps(gcp_settings(compose, "acme"))
    env = {"UMBRA_CONSOLE_PROVIDERS": "local,gcp", "UMBRA_CONSOLE_GCP": good}
    settings = settings_from_env(env)
    assert settings.gcp is not None and settings.gcp.teams["acme"].zone == "us-central1-a"
    cases = [
        ({"UMBRA_CONSOLE_GCP": ""} | {"UMBRA_CONSOLE_PROVIDERS": "gcp"}, "not a JSON object"),
        ({"UMBRA_CONSOLE_PROVIDERS": "gcp"}, "'gcp' is enabled but GCP is not set"),
        ({"UMBRA_CONSOLE_GCP": good}, "GCP is set but 'gcp' is not in PROVIDERS"),
        (env | {"UMBRA_CONSOLE_GCP": good.replace('"org"', '"orgg"')}, "UMBRA_CONSOLE_GCP.ORGG"),
        (env | {"UMBRA_CONSOLE_GCP": good.replace("acme-org/umbra/acme-gcp", "x")}, "TEAM_STACK"),
        (
            env | {"UMBRA_CONSOLE_GCP": good.replace("us-central1-a", "us-east1-b")},
            "is not in region",
        ),
        (env | {"UMBRA_CONSOLE_GCP": good.replace(str(compose), "/nonexistent")}, "cannot read"),
    ]
    for environ, message in cases:
        with pytest.raises(ConfigError, match=message):
            settings_from_env(environ)
    compose.write_text("services: {}")
    with pytest.raises(ConfigError, match=r"not an app-compose\.json document"):
        settings_from_env(env)


def test_provider_cli_launch_waits_and_reports(cloud: Cloud, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from umbra.cli.app import app

    team = cloud.gcp
    key = tmp_path / "id.pub"
    key.write_text(KEY + "\n")
    env = {"XDG_CONFIG_HOME": str(tmp_path), "COLUMNS": "200"}
    runner = CliRunner()
    token = str(team.dev.headers["Authorization"]).removeprefix("Bearer ")
    login = runner.invoke(app, ["auth", "login", cloud.server.url], input=token, env=env)
    assert login.exit_code == 0, login.output
    args = ["cvm", "launch", "--provider", "gcp", "--ssh-key", str(key), "--wait"]
    ok = runner.invoke(app, [*args, "waited", "--json"], env=env)
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["state"] == "running"
    cloud.clouds.fail_up["-doomed"] = "error: ZONE_RESOURCE_POOL_EXHAUSTED"
    bad = runner.invoke(app, [*args, "doomed"], env=env)
    assert bad.exit_code == 1
    assert "failed" in bad.output and "ZONE_RESOURCE_POOL_EXHAUSTED" in bad.output
    listed = runner.invoke(app, ["cvm", "list"], env=env)
    assert "waited" in listed.output and "10.20.0." in listed.output


def test_a_cloud_dev_cvm_records_its_ingress_and_release_for_umbra_ssh(
    tmp_path: Path,
) -> None:
    """Fails before the fix: provider_state had neither `ssh_ingress` nor `release_manifest`, so
    `GET /cvms/{id}/session` served nothing and `umbra ssh` refused every cloud Dev CVM."""
    from tests.console import enroll
    from umbra.attest.simulator import SimulatedTdx
    from umbra.components.automation import TeamTarget
    from umbra.components.config import GcpPlacement
    from umbra.console.config import GcpProvider
    from umbra.console.models import Cvm
    from umbra.console.providers import CvmSpec
    from umbra.console.providers_pulumi import PulumiCvmProvider
    from umbra.console.session_info import session_info

    compose = tmp_path / "app-compose.json"
    compose.write_text(json.dumps(APP_COMPOSE))
    config = GcpProvider.model_validate(gcp_settings(compose, "acme"))
    placement = GcpPlacement(project="acme-umbra", region="us-central1", zone="us-central1-a")
    target = TeamTarget("acme", "gcp", "acme-org/umbra/acme-gcp", gcp=placement)
    release = SimulatedTdx(enroll.pki(), image=enroll.DEV_IMAGE).release_manifest()
    provider = PulumiCvmProvider(
        "gcp", config, {"acme": target}, stack_factory=FakeClouds().factory,
        release=release.model_dump(mode="json", exclude_none=True),
    )  # fmt: skip
    spec = CvmSpec(id="cvm_0123456789abcdef", team="acme", name="main", kind="dev",
                   owner="alice", ssh_keys=(KEY,))  # fmt: skip
    done = provider.launch(spec, lambda _e: None)
    ingress = done.state["ssh_ingress"]
    assert ingress == {"host": done.state["private_ip"], "port": 8022}
    row = Cvm(
        id=spec.id, team="acme", name="main", kind="dev", owner="alice", provider="gcp",
        state="running", ssh_keys=[KEY], provider_state=done.state, created_by="alice",
    )  # fmt: skip
    info = session_info(row)
    assert info.ingress is not None and info.ingress.host == done.state["private_ip"]
    assert info.release == release
