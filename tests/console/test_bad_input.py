"""Bad input gets precise 4xx answers, never a 500 or a traceback; bodies have size limits."""

from __future__ import annotations

import httpx

from tests.console.helpers import Server, Team


def test_malformed_json_names_the_problem(team: Team) -> None:
    response = team.admin.post(
        f"/api/v1/teams/{team.name}/cvms",
        content=b'{"name": ',
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 422
    assert response.json()["detail"][0]["type"] == "json_invalid"
    missing = team.admin.post(f"/api/v1/teams/{team.name}/cvms", json={})
    assert missing.status_code == 422
    assert missing.json()["detail"][0]["loc"] == ["body", "name"]
    wrong = team.admin.post(f"/api/v1/teams/{team.name}/cvms", json={"name": "Bad Name!"})
    assert wrong.json()["detail"][0]["loc"] == ["body", "name"]
    assert "input" not in wrong.json()["detail"][0]


def test_bad_paths_and_methods(team: Team) -> None:
    assert team.admin.get("/api/v1/teams/BAD TEAM/cvms").status_code == 422
    assert team.admin.get("/api/v1/cvms/not-an-id").status_code == 422
    assert team.admin.get("/api/v1/cvms/cvm_0000000000000000").status_code == 404
    assert team.admin.get("/api/v1/nope").status_code == 404
    assert team.admin.delete("/api/v1/me").status_code == 405


def test_provider_and_routing_errors(team: Team) -> None:
    base = f"/api/v1/teams/{team.name}/cvms"
    unknown = team.admin.post(base, json={"name": "x", "provider": "gcp"})
    assert unknown.status_code == 422
    assert "not configured" in unknown.json()["detail"]
    bad_route = team.admin.post(base, json={"name": "y", "security_cvm_id": "cvm_0000000000000000"})
    assert bad_route.status_code == 422
    assert bad_route.json()["detail"].startswith("security_cvm_id")
    assert team.admin.post(base, json={"name": "z"}).status_code == 201
    assert team.admin.post(base, json={"name": "z"}).status_code == 409


def test_request_size_limits(server: Server, team: Team) -> None:
    limit = server.settings.max_request_bytes
    url = f"/api/v1/teams/{team.name}/secrets/big"
    declared = team.admin.put(
        url, content=b"x" * (limit + 1), headers={"Content-Type": "application/json"}
    )
    assert declared.status_code == 413

    def chunks() -> object:
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    with httpx.Client(base_url=server.url, headers=team.admin.headers, timeout=30) as client:
        streamed = client.put(url, content=chunks(), headers={"Content-Type": "application/json"})  # type: ignore[arg-type]
    assert streamed.status_code == 413
    # Bundles have their own, larger, limit.
    bundle_limit = server.settings.max_bundle_bytes
    big = team.admin.post(f"/api/v1/teams/{team.name}/bundles", content=b"x" * (bundle_limit + 1))
    assert big.status_code == 413
    medium = team.admin.post(f"/api/v1/teams/{team.name}/bundles", content=b"x" * (limit + 1))
    assert medium.status_code == 422  # under the bundle limit: parsed, then refused precisely


def test_metrics_are_exposed(server: Server, team: Team) -> None:
    team.admin.get(f"/api/v1/teams/{team.name}/cvms")
    with server.client() as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    text = response.text
    assert "umbra_console_http_requests_total" in text
    assert 'route="/api/v1/teams/{team}/cvms"' in text
    assert "umbra_console_traffic_records_inserted_total" in text


def test_openapi_is_served(server: Server) -> None:
    with server.client() as client:
        spec = client.get("/openapi.json").json()
    assert spec["info"]["title"] == "Umbra Console"
    assert "/api/v1/security-cvms/{cvm_id}/bundle" in spec["paths"]


def test_values_the_database_cannot_hold_are_refused(team: Team) -> None:
    from tests.console.helpers import traffic_record

    nul_owner = team.admin.post(
        f"/api/v1/teams/{team.name}/cvms", json={"name": "n", "owner": "a\x00b"}
    )
    assert nul_owner.status_code == 422
    assert nul_owner.json()["detail"][0]["loc"] == ["body", "owner"]
    batches = [
        traffic_record(team.name, host="x\x00y"),
        traffic_record(team.name, bytes_sent=1 << 64),
        traffic_record(team.name, time="9999-12-31T23:59:59-23:59"),
        traffic_record(team.name, pinned_ip="fe80::1%" + "e" * 60),
    ]
    for record in batches:  # quarantined with the reason, never a 500 (nor a blocked batch)
        response = team.scvm.post("/api/v1/traffic/batches", json={"records": [record]})
        assert response.status_code == 200, record
        assert response.json()["quarantined"] == 1, record
    url = f"/api/v1/teams/{team.name}/traffic"
    assert team.admin.get(url, params={"owner": "a\x00"}).status_code == 422
    assert team.admin.get(url, params={"since": "9999-12-31T23:59:59-23:59"}).status_code == 422
    assert (
        team.admin.get(f"/api/v1/teams/{team.name}/audit", params={"after": 1 << 40}).status_code
        == 422
    )
