"""The overview's rollups: maintained at ingest (retries and parallel batches counted once), and
the 24 h / 7 d / 30 d overview read from them equals the same window read from the records, on
both backends (parallel ingest on PostgreSQL)."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlmodel import col

from tests.console.helpers import Team, traffic_record
from umbra.console.enums import Role
from umbra.console.models import TrafficRecord, TrafficSlot
from umbra.console.services.access import User
from umbra.console.web import queries

HOSTS = ["github.com", "pypi.org", "evil.example", "x.example", None]


def _records(
    team: Team, cvm_ids: list[str | None], now: datetime, count: int
) -> list[dict[str, Any]]:
    rng = random.Random(27)
    records = []
    for _ in range(count):
        deny = rng.random() < 0.3
        fields: dict[str, Any] = {
            "time": (now - timedelta(seconds=rng.randrange(0, 12 * 86400))).isoformat(),
            "decision": "deny" if deny else "allow",
            "host": rng.choice(HOSTS),
            "reason": rng.choice(["host_not_allowed", "scan_hit", None]) if deny else "rule_allow",
            "rule_id": rng.choice(["r1", "r2", None]),
        }
        owner = rng.choice([team.dev_subject, team.admin_subject, None])
        if owner is not None:
            fields["owner"] = owner
        cvm = rng.choice(cvm_ids)
        if cvm is not None:
            fields["cvm_id"] = cvm
        records.append(traffic_record(team.name, **fields))
    return records


def _post(team: Team, batch: list[dict[str, Any]]) -> None:
    response = team.scvm.post("/api/v1/traffic/batches", json={"records": batch})
    assert response.status_code == 200, response.text


def test_overview_from_rollups_equals_the_records(team: Team) -> None:
    now = datetime.now(UTC)
    cvm_ids: list[str | None] = [team.dev_cvm(), team.dev_cvm(), None]
    records = _records(team, cvm_ids, now, 1200)
    batches = [records[i : i + 100] for i in range(0, len(records), 100)]
    # Every batch twice (a shipper's retry), in parallel on PostgreSQL.
    lock = threading.Lock()  # httpx.Client is shared: one request at a time on it per thread
    clients = [team.server.client(str(team.scvm.headers["Authorization"]).split()[1])
               for _ in range(4)]  # fmt: skip

    def send(index: int) -> None:
        client = clients[index % len(clients)]
        with lock if team.server.backend == "sqlite" else _Null():
            response = client.post("/api/v1/traffic/batches", json={"records": batches[index % len(batches)]})  # fmt: skip
        assert response.status_code == 200, response.text

    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(send, range(2 * len(batches))))
    finally:
        for client in clients:
            client.close()
    console = team.server.console
    with console.session() as session:
        stored = session.execute(
            select(func.count())
            .select_from(TrafficRecord)
            .where(col(TrafficRecord.team) == team.name)
        ).scalar_one()
        counted = session.execute(
            select(func.sum(TrafficSlot.total)).where(col(TrafficSlot.team) == team.name)
        ).scalar_one()
    assert stored == counted == len(records)
    admin = User(team.admin_subject, {team.name: Role.admin})
    developer = User(team.dev_subject, {team.name: Role.developer})
    for seconds in (86400, 604800, 2592000):
        width = seconds // queries.CHART_BUCKETS
        start, end = queries.aligned_window(now, width)
        edge = datetime.fromtimestamp(end, UTC)
        for user in (admin, developer):
            fast = queries.overview(console, user, team.name, seconds, now)
            slow = queries.overview(console, user, team.name, seconds, edge, rollups=False)
            assert fast.since == slow.since == datetime.fromtimestamp(start, UTC)
            assert fast.team == slow.team, seconds
            assert sorted((s.label, s.total, s.denied) for s in fast.cvms) == sorted(
                (s.label, s.total, s.denied) for s in slow.cvms
            )
            for got, want in (
                (fast.top_hosts, slow.top_hosts),
                (fast.top_reasons, slow.top_reasons),
                (fast.top_rules, slow.top_rules),
            ):
                assert sorted(got) == sorted(want), (seconds, got, want)
            assert sum(fast.team.total) > 0


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None
