"""An invalid host in a request is refused without being echoed back (issue #27)."""

from __future__ import annotations

from tests.console.helpers import Team

HOSTILE = "evil<script>alert(1)</script>..example.com"


def test_invalid_secret_host_is_not_echoed(team: Team) -> None:
    # Fails on the old code: the 422's msg quoted the host ("host 'evil<script>...' has ...").
    response = team.admin.put(
        f"/api/v1/teams/{team.name}/secrets/bot", json={"value": "v", "hosts": [HOSTILE]}
    )
    assert response.status_code == 422
    assert "<script>" not in response.text
    assert "evil" not in response.text
    detail = response.json()["detail"][0]
    assert "hosts" in detail["loc"]
    assert "host has a character outside letters" in detail["msg"]
