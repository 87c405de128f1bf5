"""LLM usage sums (`/teams/{team}/usage`): records carrying usage, summed per UTC day, developer,
CVM and model, on SQLite and PostgreSQL; developers see their own usage; records without usage
and other teams' never count."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tests.console.helpers import Server, Team, traffic_record


def usage_record(
    team: Team, cvm: str, owner: str, when: datetime, model: str, **tokens: int
) -> dict[str, Any]:
    return traffic_record(
        team.name,
        cvm_id=cvm,
        owner=owner,
        time=when.isoformat(),
        host="api.anthropic.com",
        path="/v1/messages",
        method="POST",
        llm_model=model,
        **{f"llm_{name}": value for name, value in tokens.items()},
    )


def test_usage_is_summed_per_day_developer_cvm_and_model(team: Team) -> None:
    dev_cvm = team.dev_cvm()
    admin_cvm = team.dev_cvm(owner=team.admin)
    # early in the UTC day, so both of today's records fall on it; `until` covers them
    today = datetime.now(UTC).replace(hour=0, minute=0, second=30, microsecond=0)
    yesterday = today - timedelta(days=1)
    records = [
        usage_record(team, dev_cvm, team.dev_subject, today, "claude-sonnet-4-5", input_tokens=100, output_tokens=10, cache_read_tokens=50),
        usage_record(team, dev_cvm, team.dev_subject, today + timedelta(minutes=5), "claude-sonnet-4-5", input_tokens=200, output_tokens=20),
        usage_record(team, dev_cvm, team.dev_subject, today, "gpt-5", input_tokens=7, output_tokens=3),
        usage_record(team, dev_cvm, team.dev_subject, yesterday, "claude-sonnet-4-5", input_tokens=1, output_tokens=1, cache_write_tokens=4),
        usage_record(team, admin_cvm, team.admin_subject, today, "claude-sonnet-4-5", input_tokens=1000, output_tokens=100),
        traffic_record(team.name, cvm_id=dev_cvm, owner=team.dev_subject),  # no usage
    ]  # fmt: skip
    response = team.scvm.post("/api/v1/traffic/batches", json={"records": records})
    assert response.status_code == 200 and response.json()["inserted"] == 6, response.text
    window = {
        "since": (yesterday - timedelta(hours=1)).isoformat(),
        "until": (today + timedelta(days=1)).isoformat(),
    }
    report = team.admin.get(f"/api/v1/teams/{team.name}/usage", params=window).json()
    rows = {(r["day"], r["owner"], r["model"]): r for r in report["rows"]}
    key = (today.date().isoformat(), team.dev_subject, "claude-sonnet-4-5")
    assert rows[key]["requests"] == 2
    assert (rows[key]["input_tokens"], rows[key]["output_tokens"]) == (300, 30)
    assert rows[key]["cache_read_tokens"] == 50 and rows[key]["cache_write_tokens"] == 0
    assert (
        rows[(yesterday.date().isoformat(), team.dev_subject, "claude-sonnet-4-5")][
            "cache_write_tokens"
        ]
        == 4
    )
    assert len(report["rows"]) == 4
    assert report["totals"]["input_tokens"] == 100 + 200 + 7 + 1 + 1000
    assert report["totals"]["requests"] == 5
    # a developer sees their own usage only, and may not ask for another's
    mine = team.dev.get(f"/api/v1/teams/{team.name}/usage", params=window).json()
    assert {r["owner"] for r in mine["rows"]} == {team.dev_subject}
    assert mine["totals"]["input_tokens"] == 308
    other = team.dev.get(f"/api/v1/teams/{team.name}/usage", params={"owner": team.admin_subject})
    assert other.status_code == 403
    by_cvm = team.admin.get(
        f"/api/v1/teams/{team.name}/usage", params={**window, "cvm_id": admin_cvm}
    ).json()
    assert by_cvm["totals"]["input_tokens"] == 1000


def test_usage_range_errors_are_precise(team: Team) -> None:
    url = f"/api/v1/teams/{team.name}/usage"
    now = datetime.now(UTC)
    backwards = team.admin.get(
        url, params={"since": now.isoformat(), "until": (now - timedelta(hours=1)).isoformat()}
    )
    assert backwards.status_code == 422 and "since must be before until" in backwards.text
    too_long = team.admin.get(url, params={"since": (now - timedelta(days=500)).isoformat()})
    assert too_long.status_code == 422 and "at most 400 days" in too_long.text


def test_umbra_usage_prints_a_table_and_json(server: Server, team: Team, tmp_path: Path) -> None:
    from tests.console.test_cli_client import Cli, token_of

    cvm = team.dev_cvm()
    now = datetime.now(UTC) - timedelta(minutes=5)
    records = [
        usage_record(team, cvm, team.dev_subject, now, "claude-opus-4-1", input_tokens=1234, output_tokens=56),
        usage_record(team, cvm, team.dev_subject, now, "claude-opus-4-1", input_tokens=1, output_tokens=1),
    ]  # fmt: skip
    assert team.scvm.post("/api/v1/traffic/batches", json={"records": records}).status_code == 200
    dev = Cli(tmp_path / "dev")
    dev("auth", "login", server.url, "--token-file", "-", input=token_of(team.dev))
    report = dev.json("usage", "--since", "1h")
    assert report["totals"]["input_tokens"] == 1235 and report["totals"]["requests"] == 2
    [row] = report["rows"]
    assert (row["owner"], row["cvm_id"], row["model"]) == (team.dev_subject, cvm, "claude-opus-4-1")
    table = dev("usage", "--since", "1h").output
    assert "claude-opus-4-1" in table and "1,235" in table
    dev("usage", "--since", "someday", code=2)
