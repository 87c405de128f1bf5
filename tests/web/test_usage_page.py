"""The usage page (`/ui/teams/{team}/usage`): LLM tokens per day, developer, CVM and model; a
developer sees their own; a hostile model name is text."""

from __future__ import annotations

from contextlib import closing
from datetime import UTC, datetime, timedelta

import pytest

from tests.console.helpers import new_team, traffic_record, unique
from tests.console.oidc_issuer import LocalIssuer
from tests.web.conftest import HOSTILE_HOST, Seed, login


@pytest.fixture(params=["pg", "sqlite"])
def seeded(request: pytest.FixtureRequest) -> Seed:
    seed: Seed = request.getfixturevalue("pg_web" if request.param == "pg" else "sqlite_web")
    return seed


def test_usage_page_sums_and_scopes(seeded: Seed, issuer: LocalIssuer) -> None:
    team = new_team(seeded.server, issuer, unique("usage"))
    cvm = team.dev_cvm("alpha")
    admin_cvm = team.dev_cvm("ops", owner=team.admin)
    when = (datetime.now(UTC) - timedelta(minutes=3)).isoformat()

    def used(cvm_id: str, owner: str, model: str, tokens: int) -> dict[str, object]:
        return traffic_record(
            team.name, cvm_id=cvm_id, owner=owner, time=when, llm_model=model,
            llm_input_tokens=tokens, llm_output_tokens=tokens // 10,
        )  # fmt: skip

    records = [
        used(cvm, team.dev_subject, "claude-sonnet-4-5", 120_000),
        used(cvm, team.dev_subject, "claude-sonnet-4-5", 3_000),
        used(admin_cvm, team.admin_subject, HOSTILE_HOST[:100], 5),
    ]
    assert team.scvm.post("/api/v1/traffic/batches", json={"records": records}).status_code == 200
    with closing(
        login(seeded.server, issuer, team.admin_subject, [f"{team.name}:admin"])
    ) as client:
        page = client.get(f"/ui/teams/{team.name}/usage")
        assert page.status_code == 200
        assert "claude-sonnet-4-5" in page.text and "123,000" in page.text
        assert "<script>window.__pwned" not in page.text  # the model name is escaped
        assert 'aria-current="page">Usage' in page.text
    with closing(
        login(seeded.server, issuer, team.dev_subject, [f"{team.name}:developer"])
    ) as client:
        mine = client.get(f"/ui/teams/{team.name}/usage")
        assert mine.status_code == 200 and "123,000" in mine.text
        assert team.admin_subject not in mine.text and "(your own)" in mine.text
    team.close()
