"""The GCP team program (stacks/Pulumi.acme-gcp.yaml) under mocks: TDX settings, measured launch
data, and the firewall topology evaluated flow by flow."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.infra.harness import ROOT, Recorder, example_raw, gcp_allows, run_program
from umbra.attest.measurement import COMPOSE_HASH_EVENT, SSH_KEYS_EVENT, ssh_keys_digest
from umbra.components.config import ConfigError, CvmConfig, TeamStack, parse_stack_config
from umbra.components.launch_data import CVM_ID_EVENT, HOST_FIREWALL_EVENT, LaunchData
from umbra.components.naming import Owner, dev_cvm_name
from umbra.components.ports import PRIVATE_ZONE, SECURITY_CVM_HOST
from umbra.components.program import build_team, read_launch_files

INSTANCE = "gcp:compute/instance:Instance"
FIREWALL = "gcp:compute/firewall:Firewall"
DEV_SA = "umbra-acme-dev@acme-umbra.iam.gserviceaccount.com"
SEC_SA = "umbra-acme-sec@acme-umbra.iam.gserviceaccount.com"
SECURITY_IP = "10.20.1.10"


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> tuple[Recorder, TeamStack]:
    cfg = parse_stack_config(example_raw("acme-gcp"), frozenset())
    assert isinstance(cfg, TeamStack)
    # An empty project root: no release under images/build, so placeholders are deployed.
    root = tmp_path_factory.mktemp("root")
    mocks, _ = run_program(lambda: build_team(cfg, root).security.instance_id)
    return mocks, cfg


def test_every_instance_is_a_tdx_shielded_c3_without_live_migration(
    acme: tuple[Recorder, TeamStack],
) -> None:
    mocks, _ = acme
    instances = mocks.of_type(INSTANCE)
    assert sorted(i.name for i in instances) == [
        "acme-alice-main",
        "acme-alice-scratch",
        "acme-bob-main",
        "acme-security",
    ]
    for inst in instances:
        p = inst.inputs
        assert p["confidentialInstanceConfig"] == {"confidentialInstanceType": "TDX"}
        assert p["scheduling"]["onHostMaintenance"] == "TERMINATE"
        assert p["machineType"].startswith("c3-")
        assert p["shieldedInstanceConfig"] == {
            "enableSecureBoot": True,
            "enableVtpm": True,
            "enableIntegrityMonitoring": True,
        }
        assert p["canIpForward"] is False
        assert p["metadata"]["block-project-ssh-keys"] == "TRUE"


def test_no_cvm_has_an_external_ip_and_only_the_security_cvm_has_the_route_tag(
    acme: tuple[Recorder, TeamStack],
) -> None:
    mocks, _ = acme
    for inst in mocks.of_type(INSTANCE):
        nic = inst.inputs["networkInterfaces"][0]
        is_security = inst.name == "acme-security"
        # The Security CVM egresses through Cloud NAT: no CVM has an access config.
        assert not nic.get("accessConfigs"), inst.name
        assert (inst.inputs.get("tags") == ["umbra-security-cvm"]) is is_security
        assert inst.inputs["serviceAccount"]["email"] == (SEC_SA if is_security else DEV_SA)
    assert (
        mocks.one(INSTANCE, "acme-security").inputs["networkInterfaces"][0]["networkIp"]
        == SECURITY_IP
    )
    routes = {r.inputs["destRange"]: r.inputs for r in mocks.of_type("gcp:compute/route:Route")}
    assert routes["0.0.0.0/0"]["tags"] == ["umbra-security-cvm"]
    # Besides it, only the Console's /32 (console_ips) for the forwarder's enrollment.
    assert set(routes) == {"0.0.0.0/0", "198.51.100.7/32"}
    (vpc,) = mocks.of_type("gcp:compute/network:Network")
    assert vpc.inputs["deleteDefaultRoutesOnCreate"] is True


def test_launch_data_carries_the_measured_inputs(acme: tuple[Recorder, TeamStack]) -> None:
    mocks, cfg = acme
    alice = next(d for d in cfg.developers if d.name == "alice")
    meta: dict[str, Any] = mocks.one(INSTANCE, "acme-alice-main").inputs["metadata"]
    events = json.loads(meta["umbra-rtmr3-events"])
    assert list(events) == [COMPOSE_HASH_EVENT, CVM_ID_EVENT, SSH_KEYS_EVENT, HOST_FIREWALL_EVENT]
    # The host ruleset is measured too (the launch agent extends its digest before loading it).
    ruleset = meta["umbra-host-firewall"].encode()
    assert events[HOST_FIREWALL_EVENT] == hashlib.sha256(ruleset).hexdigest()
    assert events[SSH_KEYS_EVENT] == ssh_keys_digest(list(alice.ssh_keys)).hex()
    name = dev_cvm_name("acme", "alice", "main", Owner.TEAM_STACK)
    assert events[CVM_ID_EVENT] == name.encode().hex()
    assert (
        events[COMPOSE_HASH_EVENT] == hashlib.sha256(meta["umbra-app-compose"].encode()).hexdigest()
    )
    assert meta["umbra-ssh-authorized-keys"].splitlines() == list(alice.ssh_keys)
    # What the forwarder's enrollment needs (measured through the ruleset that names it).
    assert meta["umbra-console-url"] == cfg.console_url
    assert meta["umbra-console-ips"] == "198.51.100.7"
    assert "ip daddr { 198.51.100.7 } tcp dport 443 ct state new accept" in ruleset.decode()
    # No release exists: the placeholder is deployed and says so where a person looks.
    inner = json.loads(meta["umbra-app-compose"])["docker_compose_file"]
    assert inner.startswith("# UMBRA PLACEHOLDER COMPOSE")
    sec_meta = mocks.one(INSTANCE, "acme-security").inputs["metadata"]
    assert "umbra-ssh-authorized-keys" not in sec_meta
    assert SSH_KEYS_EVENT not in json.loads(sec_meta["umbra-rtmr3-events"])


def test_a_release_dir_is_delivered_and_a_missing_one_is_an_error(tmp_path: Path) -> None:
    release = tmp_path / "rel"
    release.mkdir()
    app = '{"docker_compose_file":"services: {}\\n","manifest_version":2,"name":"r","runner":"docker-compose"}'
    (release / "app-compose.json").write_text(app)
    (release / "measurement-manifest.json").write_text('{"kind":"MeasurementManifest"}\n')
    cvm = CvmConfig(size="c3-standard-4", image="img", release_dir="rel")
    files = read_launch_files(tmp_path, cvm, "dev-cvm", "dev_cvm")
    assert files.app_compose == app and not files.placeholder
    digest = hashlib.sha256(b'{"kind":"MeasurementManifest"}\n').hexdigest()
    assert files.measurement_manifest == f"sha256:{digest}"
    with pytest.raises(
        ConfigError, match=r"^umbra:stack.dev_cvm.release_dir: nope has no app-compose.json"
    ):
        read_launch_files(
            tmp_path, CvmConfig(size="s", image="i", release_dir="nope"), "dev-cvm", "dev_cvm"
        )


def test_launch_events_match_the_image_pipeline() -> None:
    """umbra.images computes the same launch-bound events the launch agent will extend."""
    measure = pytest.importorskip("umbra.images.measure")
    keys = ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA+HjuKwAGfMBVi2qWrDrClbo2C0c2CXLVGvPI/rAw8V a@b"]
    ours = LaunchData(
        role="dev-cvm", team="t", cvm_id="cvm-1", app_compose="{}", ssh_authorized_keys=keys
    )
    theirs = {e.name: e.payload.hex() for e in measure.instance_events("dev-cvm", "cvm-1", keys)}
    assert {k: v for k, v in ours.expected_events().items() if k != COMPOSE_HASH_EVENT} == theirs
    assert measure.CVM_ID_EVENT == CVM_ID_EVENT


@pytest.mark.parametrize(
    ("peer", "port", "allowed"),
    [
        (SECURITY_IP, 8443, True),  # the tunnel
        (SECURITY_IP, 22, False),
        (SECURITY_IP, 8080, False),
        ("10.20.1.11", 8443, False),  # another host in the security subnet
        ("10.20.0.5", 8443, False),  # another Dev CVM
        ("8.8.8.8", 443, False),
        ("8.8.8.8", 53, False),
        ("169.254.169.254", 80, False),  # the rules say no (GCP serves metadata regardless)
    ],
)
def test_dev_cvm_egresses_only_to_its_security_cvm_tunnel(
    acme: tuple[Recorder, TeamStack], peer: str, port: int, allowed: bool
) -> None:
    mocks, _ = acme
    fws = mocks.of_type(FIREWALL)
    assert gcp_allows(fws, direction="EGRESS", target_sa=DEV_SA, peer_ip=peer, port=port) is allowed


def test_ingress_and_security_cvm_flows(acme: tuple[Recorder, TeamStack]) -> None:
    mocks, _ = acme
    fws = mocks.of_type(FIREWALL)

    def ingress(target: str, src: str, port: int, src_sa: str | None = None) -> bool:
        return gcp_allows(
            fws, direction="INGRESS", target_sa=target, peer_ip=src, port=port, peer_sa=src_sa
        )

    # Dev CVM: only the attested SSH port, only from the named range (IAP).
    assert ingress(DEV_SA, "35.235.240.7", 8022)
    assert not ingress(DEV_SA, "35.235.240.7", 22)
    assert not ingress(DEV_SA, "203.0.113.9", 8022)
    assert not ingress(DEV_SA, "10.20.1.10", 8022, src_sa=SEC_SA)
    # Security CVM: the tunnel from the team's Dev CVMs only.
    assert ingress(SEC_SA, "10.20.0.5", 8443, src_sa=DEV_SA)
    assert not ingress(SEC_SA, "203.0.113.9", 8443)
    assert not ingress(SEC_SA, "35.235.240.7", 22)

    def egress(port: int, dst: str = "93.184.215.14") -> bool:
        return gcp_allows(fws, direction="EGRESS", target_sa=SEC_SA, peer_ip=dst, port=port)

    assert egress(443) and egress(80)
    assert not egress(22) and not egress(25) and not egress(8443)


def test_the_security_cvm_name_resolves_privately_to_its_fixed_address(
    acme: tuple[Recorder, TeamStack],
) -> None:
    mocks, _ = acme
    (vpc,) = mocks.of_type("gcp:compute/network:Network")
    (zone,) = mocks.of_type("gcp:dns/managedZone:ManagedZone")
    assert zone.inputs["dnsName"] == f"{PRIVATE_ZONE}."
    assert zone.inputs["visibility"] == "private"
    networks = zone.inputs["privateVisibilityConfig"]["networks"]
    assert [n["networkUrl"] for n in networks] == [f"{vpc.name}-id"], "visible to this team only"
    (record,) = mocks.of_type("gcp:dns/recordSet:RecordSet")
    assert (record.inputs["name"], record.inputs["type"]) == (f"{SECURITY_CVM_HOST}.", "A")
    assert record.inputs["rrdatas"] == [SECURITY_IP]
    assert record.inputs["managedZone"] == zone.inputs["name"]


def test_the_example_dev_image_dials_the_name_the_network_publishes() -> None:
    definition = yaml.safe_load((ROOT / "images/definitions/dev-cvm.example.yaml").read_text())
    assert definition["host"]["security_cvm"]["host"] == SECURITY_CVM_HOST


def test_launch_data_carries_the_enrollment_token_and_never_shows_it() -> None:
    from umbra.contracts.enrollment import META_ENROLLMENT_TOKEN

    token = "enr_" + "t" * 43
    data = LaunchData(
        role="dev-cvm", team="t", cvm_id="cvm-1", app_compose="{}", enrollment_token=token
    )
    assert META_ENROLLMENT_TOKEN == "umbra-enrollment-token"
    assert data.as_metadata()[META_ENROLLMENT_TOKEN] == token
    assert token not in repr(data)
    # Not measured: it is spent at first boot and differs per launch.
    assert token.encode().hex() not in str(data.expected_events())
    without = LaunchData(role="dev-cvm", team="t", cvm_id="cvm-1", app_compose="{}")
    assert META_ENROLLMENT_TOKEN not in without.as_metadata()
