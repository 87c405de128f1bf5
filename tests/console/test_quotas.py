"""Team quotas: Dev CVMs per developer and data disk per developer and per team (parallel launches
and resizes on PostgreSQL: exactly what fits succeeds), each data disk's bounds, and the admin's
machine-type catalog, checked at launch and resize; refusals are audited."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.console.helpers import Server, Team, unique
from tests.console.test_sync_provider import Recording
from umbra.console.enums import CvmKind
from umbra.console.providers import CvmProvider

PARALLEL = 6


@pytest.mark.parametrize("server", ["postgresql"], indirect=True)
def test_parallel_launches_stop_at_the_quota(team: Team) -> None:
    quotas = f"/api/v1/teams/{team.name}/quotas"
    assert team.dev.put(quotas, json={"max_dev_cvms_per_owner": 2}).status_code == 403
    set_ = team.admin.put(quotas, json={"max_dev_cvms_per_owner": 2})
    assert set_.status_code == 200 and set_.json()["max_dev_cvms_per_owner"] == 2, set_.text
    assert team.dev.get(quotas).json()["max_dev_cvms_per_owner"] == 2
    token = str(team.dev.headers["Authorization"]).removeprefix("Bearer ")
    clients = [team.server.client(token) for _ in range(PARALLEL)]
    barrier = threading.Barrier(PARALLEL)

    def launch(client: httpx.Client) -> httpx.Response:
        barrier.wait()
        return client.post(f"/api/v1/teams/{team.name}/cvms", json={"name": unique("q")})

    try:
        with ThreadPoolExecutor(PARALLEL) as pool:
            responses = list(pool.map(launch, clients))
    finally:
        for client in clients:
            client.close()
    codes = sorted(r.status_code for r in responses)
    assert codes == [201, 201] + [409] * (PARALLEL - 2), [r.text for r in responses]
    assert all("quota" in r.json()["detail"] for r in responses if r.status_code == 409)
    # The admin is not the developer: their own count is separate.
    mine = team.admin.post(f"/api/v1/teams/{team.name}/cvms", json={"name": unique("a")})
    assert mine.status_code == 201, mine.text
    # Destroying one frees a place.
    first = next(r.json()["id"] for r in responses if r.status_code == 201)
    assert team.dev.delete(f"/api/v1/cvms/{first}").status_code == 200
    again = team.dev.post(f"/api/v1/teams/{team.name}/cvms", json={"name": unique("q")})
    assert again.status_code == 201, again.text
    entries = team.admin.get(f"/api/v1/teams/{team.name}/audit?limit=1000").json()["entries"]
    assert any(e["action"] == "team.quotas" for e in entries)


def test_machine_types_come_from_the_catalog(team: Team) -> None:
    quotas = f"/api/v1/teams/{team.name}/quotas"
    assert team.admin.put(quotas, json={"machine_types": ["small", "large"]}).status_code == 200
    refused = team.dev.post(
        f"/api/v1/teams/{team.name}/cvms", json={"name": unique("m"), "size": "huge"}
    )
    assert refused.status_code == 422 and "size" in refused.json()["detail"], refused.text
    launched = team.dev.post(
        f"/api/v1/teams/{team.name}/cvms", json={"name": unique("m"), "size": "small"}
    )
    assert launched.status_code == 201, launched.text
    resize = team.dev.patch(f"/api/v1/cvms/{launched.json()['id']}", json={"size": "huge"})
    assert resize.status_code == 422 and "size" in resize.json()["detail"], resize.text
    bad = team.admin.put(quotas, json={"max_dev_cvms_per_owner": -1})
    assert bad.status_code == 422
    assert team.admin.put(quotas, json={}).json()["machine_types"] == []


def _parallel(calls: list[Callable[[], httpx.Response]]) -> list[httpx.Response]:
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], httpx.Response]) -> httpx.Response:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def _refusals(team: Team) -> list[dict[str, Any]]:
    entries = team.admin.get(f"/api/v1/teams/{team.name}/audit?limit=1000").json()["entries"]
    return [e for e in entries if e["action"] == "cvm.quota_refused"]


@pytest.mark.parametrize("server", ["postgresql"], indirect=True)
def test_parallel_launches_stop_at_the_team_disk_quota(team: Team) -> None:
    """6 launches of 30 GB at once against a team total of 100 GB: exactly 3 succeed."""
    quotas = f"/api/v1/teams/{team.name}/quotas"
    assert team.admin.put(quotas, json={"max_data_disk_gb_total": 100}).status_code == 200
    token = str(team.dev.headers["Authorization"]).removeprefix("Bearer ")
    clients = [team.server.client(token) for _ in range(PARALLEL)]
    url = f"/api/v1/teams/{team.name}/cvms"
    try:
        responses = _parallel(
            [
                partial(c.post, url, json={"name": unique("disk"), "data_disk_gb": 30})
                for c in clients
            ]
        )
    finally:
        for client in clients:
            client.close()
    codes = sorted(r.status_code for r in responses)
    assert codes == [201] * 3 + [409] * 3, [r.text for r in responses]
    for refused in (r for r in responses if r.status_code == 409):
        detail = refused.json()["detail"]
        assert detail.startswith("quota: max_data_disk_gb_total: ") and "90 GB of 100 GB" in detail
        assert "asks for 30 GB more" in detail, detail
    usage = team.dev.get(quotas).json()["usage"]
    assert usage["team_data_disk_gb"] == 90 and usage["data_disk_gb"] == 90
    refusals = _refusals(team)
    assert len(refusals) == 3
    assert all(
        e["details"] | {"operation": "launch"}
        == {"operation": "launch", "quota": "max_data_disk_gb_total", "owner": team.dev_subject,
            "used": 90, "asked": 30, "limit": 100}
        for e in refusals
    ), refusals  # fmt: skip


@pytest.mark.parametrize("server", ["postgresql"], indirect=True)
def test_parallel_resizes_stop_at_the_team_disk_quota(team: Team) -> None:
    """Three 20 GB CVMs (60 of 100 GB) each grown to 50 GB at once: exactly one fits."""
    quotas = f"/api/v1/teams/{team.name}/quotas"
    assert team.admin.put(quotas, json={"max_data_disk_gb_total": 100}).status_code == 200
    ids = []
    for _ in range(3):
        made = team.dev.post(
            f"/api/v1/teams/{team.name}/cvms", json={"name": unique("r"), "data_disk_gb": 20}
        )
        assert made.status_code == 201, made.text
        ids.append(made.json()["id"])
    token = str(team.dev.headers["Authorization"]).removeprefix("Bearer ")
    clients = [team.server.client(token) for _ in ids]
    try:
        responses = _parallel(
            [
                partial(c.patch, f"/api/v1/cvms/{cvm_id}", json={"data_disk_gb": 50})
                for c, cvm_id in zip(clients, ids, strict=True)
            ]
        )
    finally:
        for client in clients:
            client.close()
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 409, 409], [r.text for r in responses]
    assert team.dev.get(quotas).json()["usage"]["team_data_disk_gb"] == 90
    sizes = sorted(team.dev.get(f"/api/v1/cvms/{i}").json()["data_disk_gb"] for i in ids)
    assert sizes == [20, 20, 50]
    assert {e["details"]["operation"] for e in _refusals(team)} == {"resize"}


def test_disk_bounds_and_the_developers_disk_quota(team: Team) -> None:
    quotas = f"/api/v1/teams/{team.name}/quotas"
    launch = f"/api/v1/teams/{team.name}/cvms"
    upside_down = team.admin.put(quotas, json={"min_data_disk_gb": 50, "max_data_disk_gb": 20})
    assert upside_down.status_code == 422 and "min_data_disk_gb" in upside_down.text
    limits = {"min_data_disk_gb": 20, "max_data_disk_gb": 200, "max_data_disk_gb_per_owner": 100}
    set_ = team.admin.put(quotas, json=limits)
    assert set_.status_code == 200 and set_.json()["max_data_disk_gb_per_owner"] == 100, set_.text
    (entry,) = [e for e in team.admin.get(f"/api/v1/teams/{team.name}/audit?limit=1000")
                .json()["entries"] if e["action"] == "team.quotas"]  # fmt: skip
    assert entry["details"]["max_data_disk_gb_per_owner"] == 100
    assert entry["details"]["previous"]["max_data_disk_gb_per_owner"] is None

    small = team.dev.post(launch, json={"name": unique("s"), "data_disk_gb": 10})
    assert small.status_code == 422, small.text
    assert "data_disk_gb: 10 GB is below the team's minimum of 20 GB" in small.json()["detail"]
    big = team.dev.post(launch, json={"name": unique("b"), "data_disk_gb": 300})
    assert big.status_code == 422 and "above the team's maximum of 200 GB" in big.text
    first = team.dev.post(launch, json={"name": unique("f"), "data_disk_gb": 60})
    assert first.status_code == 201 and first.json()["data_disk_gb"] == 60, first.text
    over = team.dev.post(launch, json={"name": unique("o"), "data_disk_gb": 50})
    assert over.status_code == 409, over.text
    assert over.json()["detail"].startswith(
        f"quota: max_data_disk_gb_per_owner: {team.dev_subject}'s Dev CVMs use 60 GB of 100 GB"
    )
    # The admin is another developer as far as the per-developer quota goes.
    theirs = team.admin.post(launch, json={"name": unique("a"), "data_disk_gb": 80})
    assert theirs.status_code == 201, theirs.text

    cvm = f"/api/v1/cvms/{first.json()['id']}"
    shrink = team.dev.patch(cvm, json={"data_disk_gb": 40})
    assert shrink.status_code == 422 and "only grows" in shrink.text
    grow = team.dev.patch(cvm, json={"data_disk_gb": 100})  # 60 -> 100: exactly the quota
    assert grow.status_code == 200 and grow.json()["data_disk_gb"] == 100, grow.text
    more = team.dev.patch(cvm, json={"data_disk_gb": 101})
    assert more.status_code == 409 and "asks for 1 GB more" in more.text, more.text
    # Destroying frees the space.
    assert team.dev.delete(cvm).status_code == 200
    again = team.dev.post(launch, json={"name": unique("g"), "data_disk_gb": 100})
    assert again.status_code == 201, again.text

    security = team.admin.post(
        launch, json={"name": unique("sec"), "kind": "security", "data_disk_gb": 50}
    )
    assert security.status_code == 422 and "data_disk_gb" in security.text
    # The local provider creates no disk: without a size the CVM records none and counts 0.
    bare = team.dev.post(launch, json={"name": unique("n")})
    assert bare.status_code == 201 and bare.json()["data_disk_gb"] is None, bare.text
    refusals = _refusals(team)
    assert [(e["details"]["operation"], e["details"]["quota"], e["actor"]) for e in refusals] == [
        ("launch", "max_data_disk_gb_per_owner", team.dev_subject),
        ("resize", "max_data_disk_gb_per_owner", team.dev_subject),
    ]
    assert refusals[1]["target"] == first.json()["id"]
    usage = team.dev.get(quotas).json()["usage"]
    assert usage == {"owner": team.dev_subject, "dev_cvms": 2, "data_disk_gb": 100,
                     "team_data_disk_gb": 180}  # fmt: skip


class DefaultDisk(Recording):
    default_data_disk_gb: int | None = 100


@pytest.fixture
def default_disk(server: Server) -> Iterator[DefaultDisk]:
    providers = server.console.providers
    previous: CvmProvider = providers["local"]
    provider = DefaultDisk()
    providers["local"] = provider
    try:
        yield provider
    finally:
        providers["local"] = previous


def test_the_providers_default_disk_is_recorded_and_bounded(
    team: Team, default_disk: DefaultDisk
) -> None:
    quotas = f"/api/v1/teams/{team.name}/quotas"
    launch = f"/api/v1/teams/{team.name}/cvms"
    assert team.admin.put(quotas, json={"max_data_disk_gb": 50}).status_code == 200
    refused = team.dev.post(launch, json={"name": unique("d")})
    assert refused.status_code == 422, refused.text
    assert "the provider's default 100 GB is above the team's maximum of 50 GB" in refused.text
    asked = team.dev.post(launch, json={"name": unique("d"), "data_disk_gb": 40})
    assert asked.status_code == 201 and asked.json()["data_disk_gb"] == 40, asked.text
    assert default_disk.launched[-1].data_disk_gb == 40  # what the provider was asked to create
    assert team.admin.put(quotas, json={}).status_code == 200
    default = team.dev.post(launch, json={"name": unique("d")})
    assert default.status_code == 201 and default.json()["data_disk_gb"] == 100, default.text
    assert default_disk.launched[-1].data_disk_gb == 100


def test_the_cloud_provider_creates_the_asked_data_disk(tmp_path: Path) -> None:
    from tests.console.test_providers import APP_COMPOSE, KEY, gcp_settings
    from umbra.components.automation import TeamTarget
    from umbra.components.config import GcpPlacement
    from umbra.console.config import GcpProvider
    from umbra.console.providers import CvmSpec
    from umbra.console.providers_pulumi import PulumiCvmProvider

    compose = tmp_path / "app-compose.json"
    compose.write_text(json.dumps(APP_COMPOSE))
    config = GcpProvider.model_validate(gcp_settings(compose, "acme"))
    placement = GcpPlacement(project="acme-umbra", region="us-central1", zone="us-central1-a")
    target = TeamTarget("acme", "gcp", "acme-org/umbra/acme-gcp", gcp=placement)
    provider = PulumiCvmProvider("gcp", config, {"acme": target})
    spec = CvmSpec(id="cvm_0123456789abcdef", team="acme", name="main", kind=CvmKind.dev,
                   owner="alice", ssh_keys=(KEY,))  # fmt: skip
    assert provider.default_data_disk_gb == 100
    assert provider.dev_spec(spec).data_disk_gb == 100
    assert provider.dev_spec(replace(spec, data_disk_gb=250)).data_disk_gb == 250


def test_an_emulated_data_disk_grows_and_never_shrinks(tmp_path: Path) -> None:
    from umbra.emulated.qemu import create_data_disk

    disk = tmp_path / "data.raw"
    create_data_disk(disk, 1)
    disk.write_bytes(b"kept")  # a guest's data (the file is now tiny)
    create_data_disk(disk, 2)
    assert disk.stat().st_size == 2 * 1024**3 and disk.read_bytes()[:4] == b"kept"
    create_data_disk(disk, 1)
    assert disk.stat().st_size == 2 * 1024**3
