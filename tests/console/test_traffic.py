"""Traffic log: idempotent batched ingest and filtered, paginated queries."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from tests.console.helpers import Team, traffic_record


def _ingest(team: Team, records: list[dict[str, object]]) -> dict[str, int]:
    response = team.scvm.post("/api/v1/traffic/batches", json={"records": records})
    assert response.status_code == 200, response.text
    result: dict[str, int] = response.json()
    return result


def test_ingest_is_idempotent_by_record_id(team: Team) -> None:
    cvm = team.dev_cvm()
    records = [traffic_record(team.name, cvm_id=cvm, owner=team.dev_subject) for _ in range(50)]
    assert _ingest(team, records) == {"received": 50, "inserted": 50, "duplicates": 0}
    # A retry of the whole batch, plus one new record and an in-batch repeat.
    fresh = traffic_record(team.name, cvm_id=cvm)
    assert _ingest(team, [*records, fresh, fresh]) == {
        "received": 52,
        "inserted": 1,
        "duplicates": 51,
    }
    page = team.admin.get(f"/api/v1/teams/{team.name}/traffic", params={"limit": 1000}).json()
    assert len(page["records"]) == 51
    assert page["next_cursor"] is None


def test_ingest_rejects_other_teams_and_unknown_cvms(team: Team) -> None:
    other_team = team.scvm.post(
        "/api/v1/traffic/batches", json={"records": [traffic_record("someone-else")]}
    )
    assert other_team.status_code == 422
    assert other_team.json()["detail"].startswith("records.0.team")
    unknown = team.scvm.post(
        "/api/v1/traffic/batches",
        json={
            "records": [
                traffic_record(team.name),
                traffic_record(team.name, cvm_id="cvm_" + "0" * 16),
            ]
        },
    )
    assert unknown.status_code == 422
    assert unknown.json()["detail"].startswith("records.1.cvm_id")
    bad = team.scvm.post(
        "/api/v1/traffic/batches",
        json={"records": [traffic_record(team.name, id="not-a-uuid", decision="maybe", value="x")]},
    )
    assert bad.status_code == 422
    fields = {tuple(error["loc"]) for error in bad.json()["detail"]}
    assert ("body", "records", 0, "id") in fields
    assert ("body", "records", 0, "decision") in fields
    assert ("body", "records", 0, "value") in fields
    assert team.scvm.post("/api/v1/traffic/batches", json={"records": []}).status_code == 422
    naive = traffic_record(team.name, time="2026-01-01T00:00:00")
    assert team.scvm.post("/api/v1/traffic/batches", json={"records": [naive]}).status_code == 422


def test_query_filters_and_pagination(team: Team) -> None:
    mine = team.dev_cvm()
    admins = team.dev_cvm(owner=team.admin)
    start = datetime(2026, 3, 1, tzinfo=UTC)
    records = []
    for index in range(30):
        records.append(
            traffic_record(
                team.name,
                id=str(uuid.UUID(int=index + 1)),
                time=(start + timedelta(minutes=index)).isoformat(),
                cvm_id=mine if index % 2 == 0 else admins,
                owner=team.dev_subject if index % 2 == 0 else team.admin_subject,
                host="github.com" if index % 3 == 0 else "example.com",
                decision="deny" if index % 5 == 0 else "allow",
            )
        )
    _ingest(team, records)
    url = f"/api/v1/teams/{team.name}/traffic"

    def ids(params: dict[str, object], client: object = None) -> list[int]:
        response = (client or team.admin).get(url, params=params)  # type: ignore[attr-defined]
        assert response.status_code == 200, response.text
        return [uuid.UUID(record["id"]).int - 1 for record in response.json()["records"]]

    assert ids({}) == list(range(29, -1, -1))
    assert ids({"cvm_id": mine}) == [i for i in range(29, -1, -1) if i % 2 == 0]
    assert ids({"owner": team.admin_subject}) == [i for i in range(29, -1, -1) if i % 2 == 1]
    assert ids({"host": "github.com", "decision": "deny"}) == [15, 0]
    since, until = (
        (start + timedelta(minutes=10)).isoformat(),
        (start + timedelta(minutes=13)).isoformat(),
    )
    assert ids({"since": since, "until": until}) == [12, 11, 10]
    # Developers see their own traffic only, whatever they ask for.
    assert ids({}, team.dev) == [i for i in range(29, -1, -1) if i % 2 == 0]
    # Pagination walks everything exactly once, newest first.
    seen: list[int] = []
    cursor = None
    while True:
        params: dict[str, object] = {"limit": 7}
        if cursor:
            params["cursor"] = cursor
        page = team.admin.get(url, params=params).json()
        seen.extend(uuid.UUID(record["id"]).int - 1 for record in page["records"])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(range(29, -1, -1))
    first = team.admin.get(url, params={"limit": 1}).json()["records"][0]
    assert first["time"].startswith("2026-03-01T00:29:00")
    assert first["query_keys"] == ["q"]
    assert team.admin.get(url, params={"cursor": "!!"}).status_code == 422
    assert team.admin.get(url, params={"limit": 0}).status_code == 422
    assert team.admin.get(url, params={"decision": "maybe"}).status_code == 422


def test_records_as_the_proxy_writes_them(team: Team) -> None:
    """Contract test with `umbra.proxy.trafficlog.TrafficRecord` (its spool/shipper format)."""
    from umbra.proxy.trafficlog import TrafficRecord

    cvm = team.dev_cvm()
    record = TrafficRecord(
        cvm_id=cvm,
        owner=team.dev_subject,
        team=team.name,
        method="POST",
        connect_host="api.github.com",
        sni="api.github.com",
        host_header="api.github.com",
        port=443,
        pinned_ip="140.82.112.6",
        path="/repos/acme/x/issues",
        query_keys=["page"],
        decision="allow",
        rule_id="github:egress-1",
        reason="rule_allow",
        status=201,
        request_bytes=10,
        response_bytes=20,
        duration_ms=3.5,
        injected_headers=["Authorization"],
        detail="ok",
    )
    teamless = TrafficRecord(kind="connect", decision="deny", reason="")
    documents = [record.model_dump(mode="json"), teamless.model_dump(mode="json")]
    assert _ingest(team, documents) == {"received": 2, "inserted": 2, "duplicates": 0}
    assert _ingest(team, documents)["duplicates"] == 2
    page = team.admin.get(f"/api/v1/teams/{team.name}/traffic").json()["records"]
    stored = {item["kind"]: item for item in page}
    assert stored["http"]["host"] == "api.github.com"
    assert (stored["http"]["bytes_sent"], stored["http"]["bytes_received"]) == (10, 20)
    assert stored["http"]["detail"] == "ok"
    assert stored["http"]["id"] == str(uuid.UUID(record.id))
    assert stored["connect"]["team"] == team.name
