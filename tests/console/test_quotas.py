"""Team quotas: Dev CVMs per developer (parallel launches by one developer on PostgreSQL: exactly
the quota's number succeed) and the admin's machine-type catalog, checked at launch and resize."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.console.helpers import Team, unique

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
