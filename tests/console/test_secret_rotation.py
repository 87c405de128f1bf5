"""Conditional secret rotation (If-Match on the version) and the Security CVM's secrets-version
long poll waking at once on a change, on both database backends."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from tests.console.helpers import Server, Team, unique


def test_rotation_is_conditional_on_the_version(team: Team) -> None:
    url = f"/api/v1/teams/{team.name}/secrets/{unique('s')}"
    body = {"value": "first-value-1", "hosts": ["api.example.com"]}
    # If-Match on a secret that does not exist: nothing is created.
    assert team.admin.put(url, json=body, headers={"If-Match": '"1"'}).status_code == 412
    assert team.admin.put(url, json=body).json()["version"] == 1
    rotated = team.admin.put(url, json=body | {"value": "second-2"}, headers={"If-Match": '"1"'})
    assert rotated.status_code == 200 and rotated.json()["version"] == 2
    stale = team.admin.put(url, json=body | {"value": "third-3"}, headers={"If-Match": '"1"'})
    assert stale.status_code == 412
    assert "is at version 2, not version 1" in stale.json()["detail"]
    assert "third-3" not in stale.text
    bad = team.admin.put(url, json=body, headers={"If-Match": '"v2"'})
    assert bad.status_code == 422 and "If-Match" in bad.text
    # Personal secrets take the same precondition.
    mine = f"/api/v1/teams/{team.name}/personal-secrets/{unique('p')}"
    assert team.dev.put(mine, json=body).status_code == 200
    assert team.dev.put(mine, json=body, headers={"If-Match": '"2"'}).status_code == 412
    assert team.dev.put(mine, json=body, headers={"If-Match": '"1"'}).json()["version"] == 2


@contextmanager
def slow_database_recheck(server: Server) -> Iterator[None]:
    """Only the notifier can wake a long poll promptly: the periodic database recheck (which
    covers other Console replicas) is pushed far out for the duration."""
    console = server.console
    saved = console.settings
    # model_copy skips validation on purpose: the setting is capped at 1 s in production.
    console.settings = saved.model_copy(update={"long_poll_db_interval_seconds": 30.0})
    try:
        yield
    finally:
        console.settings = saved


def _poll_in_thread(team: Team, etag: str) -> tuple[threading.Thread, dict[str, Any]]:
    url = f"/api/v1/security-cvms/{team.scvm_id}/secrets/version"
    result: dict[str, Any] = {}

    def run() -> None:
        with httpx.Client(base_url=team.server.url, headers=team.scvm.headers, timeout=60) as c:
            result["response"] = c.get(url, params={"wait": 20}, headers={"If-None-Match": etag})
        result["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_secret_changes_wake_the_secrets_long_poll_at_once(team: Team) -> None:
    version_url = f"/api/v1/security-cvms/{team.scvm_id}/secrets/version"
    secret_url = f"/api/v1/teams/{team.name}/secrets/{unique('s')}"
    changes = [
        lambda: team.admin.put(secret_url, json={"value": "v-one", "hosts": ["a.example"]}),
        lambda: team.admin.put(
            secret_url, json={"value": "v-two", "hosts": ["a.example"]}, headers={"If-Match": '"1"'}
        ),
        lambda: team.admin.delete(secret_url),
    ]
    with slow_database_recheck(team.server):
        for change in changes:  # set, rotate, delete
            etag = team.scvm.get(version_url).headers["etag"]
            thread, result = _poll_in_thread(team, etag)
            time.sleep(0.4)  # the poll is waiting
            changed_at = time.monotonic()
            assert change().status_code in (200, 204)
            thread.join(timeout=25)
            assert result["response"].status_code == 200
            assert result["response"].headers["etag"] != etag
            assert result["at"] - changed_at < 2.0
