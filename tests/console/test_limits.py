"""Smaller hardening: release challenges rate-limited per Security CVM, the access log without
query strings, and database errors logged by type only."""

from __future__ import annotations

import logging

from tests.console.helpers import Team
from umbra.console.serve import DropQueryString


def test_release_challenges_are_rate_limited_per_security_cvm(team: Team) -> None:
    url = f"/api/v1/security-cvms/{team.scvm_id}/release-challenge"
    limit = team.server.settings.release_challenges_per_minute
    statuses = [team.scvm.post(url).status_code for _ in range(limit)]
    assert statuses == [200] * limit
    refused = team.scvm.post(url)
    assert refused.status_code == 429 and refused.headers["Retry-After"]


def test_access_log_drops_query_strings() -> None:
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:1", "GET", "/api/v1/teams/t/traffic?owner=alice&host=x", "1.1", 200),
        None,
    )
    assert DropQueryString().filter(record)
    assert record.getMessage() == '127.0.0.1:1 - "GET /api/v1/teams/t/traffic HTTP/1.1" 200'
