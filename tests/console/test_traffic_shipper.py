"""Poison records: the proxy's real spool and shipper against a real Console.

A record the sandbox shaped to be as large as the proxy allows, a record from an older spool that no
longer validates, and a corrupt line must neither stop the shipper nor hide the records after them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from tests.console.helpers import Team
from umbra.contracts.traffic import TrafficRecord
from umbra.proxy.spool import Shipper, Spool


def test_poison_records_never_block_the_log(team: Team, tmp_path: Path) -> None:
    cvm = team.dev_cvm()
    spool = Spool(tmp_path / "spool")
    try:
        before = TrafficRecord.build(
            team=team.name, cvm_id=cvm, decision="allow", reason="rule_allow"
        )
        # Everything the sandbox controls, at the proxy's limits and beyond.
        huge = TrafficRecord.build(
            team=team.name,
            cvm_id=cvm,
            method="X" * 40,
            host_header="h" * 300,
            connect_host="c" * 260,
            path="/" + "p" * 20000,
            query_keys=["k\x01" * 200] * 300,
            decision="deny",
            reason="no_rule",
            detail="d" * 300,
        )
        spool.append(before)
        spool.append(huge)
        spool.flush()
    finally:
        spool.close()
    # A line an older proxy wrote that the Console cannot accept, a torn line, then a good record.
    after = TrafficRecord.build(team=team.name, decision="allow", reason="rule_allow")
    segment = tmp_path / "spool" / "segment-00000099.jsonl"
    segment.write_text(
        json.dumps({"id": "old", "decision": "maybe", "kind": "gopher"})
        + "\n{torn\n"
        + after.model_dump_json()
        + "\n"
    )

    async def ship() -> int:
        async with httpx.AsyncClient(
            headers={"Authorization": team.scvm.headers["Authorization"]}, timeout=30
        ) as client:
            shipper = Shipper(tmp_path / "spool", team.server.url, batch_size=2, client=client)
            for _ in range(10):
                if await shipper.ship_once() < 0:
                    raise AssertionError("the Console refused a batch")
            return shipper.shipped

    assert asyncio.run(ship()) == 4
    stored = team.admin.get(f"/api/v1/teams/{team.name}/traffic").json()["records"]
    by_id = {item["id"]: item for item in stored}
    assert set(by_id) == {str(before.id), str(huge.id), str(after.id)}
    cut = by_id[str(huge.id)]
    assert cut["truncated"] == ["host", "method", "path", "query_keys"]
    assert len(cut["host"]) == 260 and len(cut["path"]) == 8192 and len(cut["method"]) == 32
    quarantined = team.admin.get(f"/api/v1/teams/{team.name}/traffic/quarantine").json()
    assert [(item["reason"], item["record_id"]) for item in quarantined["records"]] == [
        ("invalid", "old")
    ]
