"""The metadata stand-in (umbra.emulated.metadata) answers as GCP's metadata server and as Azure's
IMDS and wire server do, checked on the protocol and with the launch agent's own clients (the
code a booted image runs), over loopback. Fast: no VM."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import httpx
import pytest

from umbra.components.launch_data import LaunchData
from umbra.emulated.metadata import EmulatedMetadata, Shape
from umbra.images.launch_agent import (
    AzureUserData,
    AzureWireServer,
    GcpGuestAttribute,
    GcpMetadata,
    enrollment_token,
    parse_launch_data,
)
from umbra.images.measure import measure

from ..sandbox.fixtures import dev_definition

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice"
TOKEN = "enroll-0123456789abcdef-secret"


@pytest.fixture(scope="module")
def launch() -> LaunchData:
    return LaunchData(
        role="dev-cvm",
        team="team-a",
        cvm_id="cvm_0000000000000a11",
        app_compose=measure(dev_definition()).app_compose.decode(),
        ssh_authorized_keys=(KEY,),
        enrollment_token=TOKEN,
    )


@pytest.fixture
def gcp(launch: LaunchData) -> Iterator[EmulatedMetadata]:
    with EmulatedMetadata(Shape.gcp, launch, "dev-1").serving() as stand_in:
        yield stand_in


@pytest.fixture
def azure(launch: LaunchData) -> Iterator[EmulatedMetadata]:
    with EmulatedMetadata(Shape.azure, launch, "dev-1").serving() as stand_in:
        yield stand_in


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def test_gcp_answers_only_with_the_flavor_header_and_says_it_back(gcp: EmulatedMetadata) -> None:
    base = _url(gcp.metadata_port) + "/computeMetadata/v1/instance/attributes/"
    assert httpx.get(base).status_code == 403
    assert httpx.get(base, headers={"Metadata-Flavor": "google"}).status_code == 403
    proxied = {"Metadata-Flavor": "Google", "X-Forwarded-For": "10.0.0.9"}
    assert httpx.get(base, headers=proxied).status_code == 403
    flavor = {"Metadata-Flavor": "Google"}
    listing = httpx.get(base, headers=flavor)
    assert listing.status_code == 200 and listing.headers["Metadata-Flavor"] == "Google"
    # What components.gcp_vm puts in the instance's metadata, key for key.
    want = gcp.launch.gcp_metadata()
    assert listing.text.splitlines() == sorted(want)
    doc = httpx.get(base, params={"recursive": "true"}, headers=flavor).json()
    assert doc == want and doc["block-project-ssh-keys"] == "TRUE"
    one = httpx.get(base + "umbra-role", headers=flavor)
    assert one.text == "dev-cvm"
    assert httpx.get(base + "no-such-key", headers=flavor).status_code == 404
    # An Azure path on GCP's server does not exist.
    assert httpx.get(_url(gcp.metadata_port) + "/metadata/instance").status_code == 404


def test_the_agent_reads_gcp_launch_data_and_reports_ready(gcp: EmulatedMetadata) -> None:
    meta = GcpMetadata(_url(gcp.metadata_port)).fetch()
    assert meta == gcp.launch.as_metadata()  # the umbra-* keys, GCP's own left out
    data = parse_launch_data(meta, "gcp")
    assert data.compose_sha256 == gcp.launch.compose_sha256
    assert gcp.ready == []
    GcpGuestAttribute(_url(gcp.metadata_port)).ready(data)
    (report,) = gcp.ready
    assert (report.shape, report.boot, report.detail) == (Shape.gcp, 1, data.compose_sha256)
    gcp.restart()
    GcpGuestAttribute(_url(gcp.metadata_port)).ready(data)
    assert gcp.wait_ready(2, 1) is not None


def test_azure_imds_needs_its_header_and_an_api_version(azure: EmulatedMetadata) -> None:
    url = _url(azure.metadata_port) + "/metadata/instance/compute/userData"
    q = {"api-version": "2021-01-01", "format": "text"}
    missing = httpx.get(url, params=q)
    assert missing.status_code == 400 and "metadata header" in missing.json()["error"]
    no_version = httpx.get(url, params={"format": "text"}, headers={"Metadata": "true"})
    assert no_version.status_code == 400 and "api-version" in no_version.json()["error"]
    proxied = httpx.get(url, params=q, headers={"Metadata": "true", "X-Forwarded-For": "1.2.3.4"})
    assert proxied.status_code == 403
    ok = httpx.get(url, params=q, headers={"Metadata": "true"})
    # What components.azure_vm sets as the VM's userData: base64 of {"umbra": {...}}.
    assert ok.status_code == 200 and ok.text == azure.launch.azure_user_data()
    assert json.loads(base64.b64decode(ok.text))["umbra"] == azure.launch.as_metadata()
    # GCP's path on Azure's IMDS does not exist; nor does the wire server answer for GCP.
    flavor = {"Metadata-Flavor": "Google"}
    assert (
        httpx.get(_url(azure.metadata_port) + "/computeMetadata/v1/", headers=flavor).status_code
        == 404
    )


def test_the_agent_reads_azure_user_data_and_reports_ready_per_incarnation(
    azure: EmulatedMetadata,
) -> None:
    meta = AzureUserData(_url(azure.metadata_port)).fetch()
    data = parse_launch_data(meta, "azure")
    assert enrollment_token(meta) == TOKEN
    wire = AzureWireServer(_url(azure.wire_port))
    wire.ready(data)
    (first,) = azure.ready
    assert first.shape is Shape.azure and first.boot == 1
    assert first.detail.startswith("1/") and first.detail.endswith("/dev-1._0")
    # A stop and start (Azure: the VM re-created) is a new incarnation and container: a health
    # report for the old goal state is refused, one for the new accepted.
    azure.restart()
    stale = httpx.post(
        _url(azure.wire_port) + "/machine/?comp=health",
        content=_health(first.detail),
        headers={"x-ms-version": "2012-11-30"},
    )
    assert stale.status_code == 400
    wire.ready(data)
    second = azure.wait_ready(2, 1)
    assert second is not None and second.detail.split("/")[1] != first.detail.split("/")[1]


def test_the_wire_server_wants_its_version_header(azure: EmulatedMetadata) -> None:
    goal = httpx.get(_url(azure.wire_port) + "/machine/?comp=goalstate")
    assert goal.status_code == 400
    goal = httpx.get(
        _url(azure.wire_port) + "/machine/?comp=goalstate", headers={"x-ms-version": "2012-11-30"}
    )
    assert goal.status_code == 200 and "<Incarnation>1</Incarnation>" in goal.text


def test_a_gcp_vm_has_no_wire_server(gcp: EmulatedMetadata) -> None:
    r = httpx.get(
        _url(gcp.wire_port) + "/machine/?comp=goalstate", headers={"x-ms-version": "2012-11-30"}
    )
    assert r.status_code == 404


def test_the_enrollment_token_is_served_to_the_guest_and_nowhere_else(
    gcp: EmulatedMetadata,
) -> None:
    """The stand-in records what was asked, never what it answered."""
    GcpMetadata(_url(gcp.metadata_port)).fetch()
    assert gcp.requests and not any(TOKEN in r for r in gcp.requests)
    assert TOKEN not in repr(gcp.launch)


def _health(detail: str) -> str:
    inc, cid, iid = detail.split("/")
    return (
        f"<Health><GoalStateIncarnation>{inc}</GoalStateIncarnation><Container><ContainerId>"
        f"{cid}</ContainerId><RoleInstanceList><Role><InstanceId>{iid}</InstanceId><Health>"
        "<State>Ready</State></Health></Role></RoleInstanceList></Container></Health>"
    )
