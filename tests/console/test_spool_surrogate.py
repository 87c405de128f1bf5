"""Lone surrogates (issue #27): a path with one is recorded escaped, and a spool line holding one
is quarantined while shipping continues. The proxy's real spool and shipper, a real Console."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from tests.console.helpers import Team
from umbra.contracts.traffic import TrafficRecord
from umbra.proxy.spool import QUARANTINE, Shipper, Spool


def test_a_lone_surrogate_is_escaped_and_a_poison_line_quarantined(
    team: Team, tmp_path: Path
) -> None:
    cvm = team.dev_cvm()
    spool_dir = tmp_path / "spool"
    spool = Spool(spool_dir)
    try:
        # mitmproxy decodes a raw 0xff byte in a path with surrogateescape: "\udcff".
        # Fails on the old code: `build` dropped the path (and the host, the query keys).
        escaped = TrafficRecord.build(
            team=team.name,
            cvm_id=cvm,
            host_header="h\udcff.example",
            path="/a\udcffb",
            query_keys=["k\ud800"],
            decision="deny",
            reason="no_matching_rule",
        )
        assert escaped.path == "/a\\udcffb"
        assert escaped.host == "h\\udcff.example"
        assert escaped.query_keys == ["k\\ud800"]
        assert escaped.truncated == ["host", "path", "query_keys"]
        spool.append(escaped)
        spool.flush()
    finally:
        spool.close()
    # A line some other writer left: valid JSON whose path is a lone-surrogate escape, then a
    # record after it. Fails on the old code: httpx cannot encode the batch (UnicodeEncodeError)
    # and the shipper retried the same batch forever.
    after = TrafficRecord.build(team=team.name, decision="allow", reason="rule_allow")
    poison = (
        '{"id": "00000000-0000-4000-8000-000000000001", "decision": "deny", "path": "/x\\udcff"}'
    )
    segment = spool_dir / "segment-00000099.jsonl"
    segment.write_text(poison + "\n" + after.model_dump_json() + "\n")

    async def ship() -> Shipper:
        async with httpx.AsyncClient(
            headers={"Authorization": team.scvm.headers["Authorization"]}, timeout=30
        ) as client:
            shipper = Shipper(spool_dir, team.server.url, batch_size=10, client=client)
            for _ in range(5):
                if await shipper.ship_once() < 0:
                    raise AssertionError("the Console refused a batch")
            return shipper

    shipper = asyncio.run(ship())
    assert (shipper.shipped, shipper.quarantined) == (2, 1)
    stored = team.admin.get(f"/api/v1/teams/{team.name}/traffic").json()["records"]
    by_id = {item["id"]: item for item in stored}
    assert set(by_id) == {str(escaped.id), str(after.id)}
    assert by_id[str(escaped.id)]["path"] == "/a\\udcffb"
    assert by_id[str(escaped.id)]["truncated"] == ["host", "path", "query_keys"]
    # The record of the fault: where, why, and the line (escaped, so the file stays UTF-8).
    entries = [json.loads(line) for line in (spool_dir / QUARANTINE).read_text().splitlines()]
    assert [(e["segment"], e["offset"], e["fault"]) for e in entries] == [
        ("segment-00000099.jsonl", 0, "lone_surrogate")
    ]
    assert entries[0]["line"] == poison
    assert (spool_dir / QUARANTINE).stat().st_mode & 0o777 == 0o600
    # Nothing is left to ship, and the quarantined line is not sent again.
    assert asyncio.run(_ship_once(spool_dir, team)) == 0


async def _ship_once(spool_dir: Path, team: Team) -> int:
    async with httpx.AsyncClient(
        headers={"Authorization": team.scvm.headers["Authorization"]}, timeout=30
    ) as client:
        shipper = Shipper(spool_dir, team.server.url, client=client)
        sent = await shipper.ship_once()
        assert shipper.quarantined == 0
        return sent
