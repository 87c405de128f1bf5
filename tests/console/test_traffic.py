"""Traffic log: idempotent batched ingest and filtered, paginated queries."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from tests.console.helpers import Server, Team, new_team, traffic_record
from tests.console.oidc_issuer import LocalIssuer


def _ingest(team: Team, records: list[dict[str, object]]) -> dict[str, int]:
    response = team.scvm.post("/api/v1/traffic/batches", json={"records": records})
    assert response.status_code == 200, response.text
    result: dict[str, int] = response.json()
    return result


def test_ingest_is_idempotent_by_record_id(team: Team) -> None:
    cvm = team.dev_cvm()
    records = [traffic_record(team.name, cvm_id=cvm, owner=team.dev_subject) for _ in range(50)]
    assert _ingest(team, records) == {
        "received": 50,
        "inserted": 50,
        "duplicates": 0,
        "quarantined": 0,
    }
    # A retry of the whole batch, plus one new record and an in-batch repeat.
    fresh = traffic_record(team.name, cvm_id=cvm)
    assert _ingest(team, [*records, fresh, fresh]) == {
        "received": 52,
        "inserted": 1,
        "duplicates": 51,
        "quarantined": 0,
    }
    page = team.admin.get(f"/api/v1/teams/{team.name}/traffic", params={"limit": 1000}).json()
    assert len(page["records"]) == 51
    assert page["next_cursor"] is None


def test_bad_records_are_quarantined_never_blocking_the_batch(team: Team) -> None:
    """Another team, an unknown Dev CVM, or a record that does not validate: each is stored aside
    with its reason, and every good record of the same batch is stored."""
    good = [traffic_record(team.name) for _ in range(3)]
    bad = [
        traffic_record("someone-else"),
        traffic_record(team.name, cvm_id="cvm_" + "0" * 16),
        traffic_record(team.name, id="not-a-uuid", decision="maybe", value="s3cr3t-v4lue"),
        traffic_record(team.name, time="2026-01-01T00:00:00"),  # no offset
        "not even an object",
    ]
    batch = {"records": [good[0], *bad[:2], good[1], *bad[2:], good[2]]}
    result = _ingest(team, batch["records"])
    assert result == {"received": 8, "inserted": 3, "duplicates": 0, "quarantined": 5}
    # The shipper retries: nothing new is stored or quarantined twice.
    assert _ingest(team, batch["records"])["inserted"] == 0
    url = f"/api/v1/teams/{team.name}/traffic/quarantine"
    listed = team.admin.get(url).json()["records"]
    assert sorted(item["reason"] for item in listed) == sorted(
        ["foreign_team", "unknown_cvm", "invalid", "invalid", "invalid"]
    )
    invalid = " ".join(item["detail"] for item in listed if item["reason"] == "invalid")
    assert "id: uuid_parsing" in invalid and "decision: enum" in invalid
    assert "s3cr3t" not in invalid  # the reason names fields, never values
    assert team.dev.get(url).status_code == 403
    stored = team.admin.get(f"/api/v1/teams/{team.name}/traffic").json()["records"]
    assert {item["id"] for item in stored} == {item["id"] for item in good}
    # Only a body that is not a batch at all is refused.
    assert team.scvm.post("/api/v1/traffic/batches", json={"records": []}).status_code == 422
    assert team.scvm.post("/api/v1/traffic/batches", json={"rows": [good[0]]}).status_code == 422


def test_record_ids_are_scoped_per_team(team: Team, server: Server, issuer: LocalIssuer) -> None:
    """Another team's Security CVM reusing a record id neither suppresses nor overwrites it."""
    other = new_team(server, issuer)
    try:
        record = traffic_record(team.name)
        assert _ingest(team, [record])["inserted"] == 1
        assert _ingest(other, [{**record, "team": other.name}])["inserted"] == 1
        mine = team.admin.get(f"/api/v1/teams/{team.name}/traffic").json()["records"]
        assert [item["id"] for item in mine] == [record["id"]]
    finally:
        other.close()


def test_oversized_fields_are_truncated_and_marked(team: Team) -> None:
    """What the proxy can produce (260-char hosts, 8 KiB paths, raw method tokens) fits."""
    from umbra.contracts.traffic import TrafficRecord

    host = ("a" * 60 + ".") * 4 + "example.com:443"
    record = TrafficRecord.build(
        decision="deny",
        method="PROPFIND-EXTENDED-VERB-X",
        host_header=host + "x" * 100,
        connect_host=host,
        path="/" + "p" * 9000,
        reason="no_rule",
        detail="bad\x00byte",
    )
    assert record.truncated == ["detail", "host", "path"]
    assert _ingest(team, [record.wire()])["inserted"] == 1
    stored = team.admin.get(f"/api/v1/teams/{team.name}/traffic").json()["records"][0]
    assert stored["method"] == "PROPFIND-EXTENDED-VERB-X"
    assert stored["connect_host"] == host and len(stored["host"]) == 260
    assert len(stored["path"]) == 8192
    assert stored["truncated"] == ["detail", "host", "path"]


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
    """Contract test: records as the proxy builds them (`TrafficRecord.build`) and spools them."""
    from umbra.contracts.traffic import TrafficRecord

    cvm = team.dev_cvm()
    record = TrafficRecord.build(
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
    teamless = TrafficRecord.build(kind="connect", decision="deny", reason="")
    documents = [record.wire(), teamless.wire()]
    assert _ingest(team, documents) == {
        "received": 2,
        "inserted": 2,
        "duplicates": 0,
        "quarantined": 0,
    }
    assert _ingest(team, documents)["duplicates"] == 2
    page = team.admin.get(f"/api/v1/teams/{team.name}/traffic").json()["records"]
    stored = {item["kind"]: item for item in page}
    assert stored["http"]["host"] == "api.github.com"
    assert (stored["http"]["bytes_sent"], stored["http"]["bytes_received"]) == (10, 20)
    assert stored["http"]["detail"] == "ok"
    assert stored["http"]["id"] == str(record.id)
    assert stored["connect"]["team"] == team.name
