"""Deactivating a developer (`POST /teams/{team}/members/{sub}/deactivate`, `umbra user
deactivate`): their token carries no role in the team from the next request on, their personal
secrets are erased from the database, their Dev CVMs are detached and stopped, and all of it is
audited; only an admin may, never on themselves; on both backends."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select
from sqlmodel import col

from tests.console.helpers import Team, standard_bundle
from tests.console.test_cli_admin import Cli
from umbra.console.models import Secret

PERSONAL = "personal-value-Zq81xT0w"


def _personal_rows(team: Team, owner: str) -> int:
    with team.server.console.session() as session:
        count: int = session.execute(
            select(func.count())
            .select_from(Secret)
            .where(col(Secret.team) == team.name, col(Secret.owner) == owner)
        ).scalar_one()
    return count


def _dev_with_a_profile_and_a_secret(team: Team) -> str:
    """The developer's Dev CVM (returned) with the `github` profile, and their personal secret."""
    assert team.upload(1, standard_bundle(team.server.bundle_key, 1)).status_code == 201
    cvm_id = team.dev_cvm()
    attached = team.admin.put(f"/api/v1/cvms/{cvm_id}/profiles", json={"profiles": ["github"]})
    assert attached.status_code == 200, attached.text
    put = team.dev.put(
        f"/api/v1/teams/{team.name}/personal-secrets/gh",
        json={"value": PERSONAL, "hosts": ["api.github.com"]},
    )
    assert put.status_code in (200, 201), put.text
    return cvm_id


def test_deactivate_a_developer(team: Team, tmp_path: Path) -> None:
    cvm_id = _dev_with_a_profile_and_a_secret(team)
    assert _personal_rows(team, team.dev_subject) == 1
    url = f"/api/v1/teams/{team.name}/members/{team.dev_subject}/deactivate"

    assert team.dev.post(url).status_code == 403  # a developer may not
    own = f"/api/v1/teams/{team.name}/members/{team.admin_subject}/deactivate"
    assert team.admin.post(own).status_code == 422  # nor an admin on themselves

    admin = Cli(tmp_path / "admin")
    token = str(team.admin.headers["Authorization"]).removeprefix("Bearer ")
    admin("auth", "login", team.server.url, "--token-file", "-", "--team", team.name, input=token)
    done: dict[str, Any] = admin.json("user", "deactivate", team.dev_subject)
    assert done["newly"] is True and done["secrets_erased"] == 1
    assert done["cvms_detached"] == [cvm_id] and done["cvms_skipped"] == {}

    # The same token, the next request: no role in the team.
    assert team.dev.get(f"/api/v1/teams/{team.name}/cvms").status_code == 403
    assert team.dev.get(f"/api/v1/teams/{team.name}/personal-secrets").status_code == 403
    assert _personal_rows(team, team.dev_subject) == 0
    cvm = team.admin.get(f"/api/v1/cvms/{cvm_id}").json()
    assert cvm["profiles"] == []
    assert cvm["state"] in ("stopped", "updating") or cvm_id in done["cvms_stopped"]
    entries = team.admin.get(f"/api/v1/teams/{team.name}/audit?limit=1000").json()["entries"]
    deactivations = [e for e in entries if e["action"] == "user.deactivate"]
    assert [(e["target"], e["details"]["secrets_erased"]) for e in deactivations] == [
        (team.dev_subject, 1)
    ]
    # Idempotent: again is fine and says so.
    again = team.admin.post(url)
    assert again.status_code == 200 and again.json()["newly"] is False
    # The erased value is nowhere in what the Console answered.
    assert not any(PERSONAL.encode() in body for body in team.server.responses)


def test_reactivate_a_developer(team: Team, tmp_path: Path) -> None:
    """`umbra user reactivate`: their token has its role again from the next request on; what
    the deactivation erased or detached stays so; audited; idempotent; admins only."""
    cvm_id = _dev_with_a_profile_and_a_secret(team)
    members = f"/api/v1/teams/{team.name}/members"
    # A developer may not reactivate anyone (here: the admin, who is active).
    assert team.dev.post(f"{members}/{team.admin_subject}/reactivate").status_code == 403

    admin = Cli(tmp_path / "admin")
    token = str(team.admin.headers["Authorization"]).removeprefix("Bearer ")
    admin("auth", "login", team.server.url, "--token-file", "-", "--team", team.name, input=token)
    # Never deactivated: nothing changes, and it says so.
    never = admin.json("user", "reactivate", team.dev_subject)
    assert never["newly"] is False and never["deactivated_by"] is None
    assert admin.json("user", "deactivate", team.dev_subject)["secrets_erased"] == 1
    assert team.dev.get(f"/api/v1/teams/{team.name}/cvms").status_code == 403

    said = admin("user", "reactivate", team.dev_subject).stdout
    assert f"{team.dev_subject} reactivated in {team.name}" in said, said
    assert team.admin_subject in said
    # The same token, the next request: their role again.
    listed = team.dev.get(f"/api/v1/teams/{team.name}/cvms")
    assert listed.status_code == 200 and cvm_id in listed.text
    personal = team.dev.get(f"/api/v1/teams/{team.name}/personal-secrets")
    assert personal.status_code == 200, personal.text
    # What the deactivation erased stays gone; the CVM stays detached until an admin attaches.
    assert _personal_rows(team, team.dev_subject) == 0 and "gh" not in personal.text
    assert team.admin.get(f"/api/v1/cvms/{cvm_id}").json()["profiles"] == []
    # Idempotent.
    again = admin.json("user", "reactivate", team.dev_subject)
    assert again["newly"] is False
    entries = team.admin.get(f"/api/v1/teams/{team.name}/audit?limit=1000").json()["entries"]
    reactivations = [e for e in entries if e["action"] == "user.reactivate"]
    assert [(e["target"], e["actor"], e["details"]["already"]) for e in reactivations] == [
        (team.dev_subject, team.admin_subject, True),
        (team.dev_subject, team.admin_subject, False),
        (team.dev_subject, team.admin_subject, True),
    ]
    assert reactivations[1]["details"]["deactivated_by"] == team.admin_subject
    # Deactivating again is a new deactivation (the row was gone).
    assert admin.json("user", "deactivate", team.dev_subject)["newly"] is True
    assert team.dev.get(f"/api/v1/teams/{team.name}/cvms").status_code == 403
    assert not any(PERSONAL in out for out in admin.outputs)
    assert not any(PERSONAL.encode() in body for body in team.server.responses)


PARALLEL = 6


def test_parallel_reactivations_and_deactivations_count_once(team: Team) -> None:
    """Parallel admins (real clients, both backends): of 6 reactivations of one developer exactly
    one is `newly` and one audit entry says so; then the same for 6 deactivations."""
    token = str(team.admin.headers["Authorization"]).removeprefix("Bearer ")
    members = f"/api/v1/teams/{team.name}/members/{team.dev_subject}"
    assert team.admin.post(f"{members}/deactivate").json()["newly"] is True

    def race(verb: str) -> list[httpx.Response]:
        clients = [team.server.client(token) for _ in range(PARALLEL)]
        barrier = threading.Barrier(PARALLEL)

        def call(client: httpx.Client) -> httpx.Response:
            barrier.wait()
            return client.post(f"{members}/{verb}")

        try:
            with ThreadPoolExecutor(PARALLEL) as pool:
                return list(pool.map(call, clients))
        finally:
            for client in clients:
                client.close()

    for verb, action in (("reactivate", "user.reactivate"), ("deactivate", "user.deactivate")):
        responses = race(verb)
        assert [r.status_code for r in responses] == [200] * PARALLEL, [r.text for r in responses]
        assert sum(r.json()["newly"] for r in responses) == 1, verb
        entries = team.admin.get(f"/api/v1/teams/{team.name}/audit?limit=1000").json()["entries"]
        fresh = [e for e in entries if e["action"] == action and not e["details"]["already"]]
        assert len(fresh) == (1 if verb == "reactivate" else 2), verb  # + the first deactivation
    assert team.dev.get(f"/api/v1/teams/{team.name}/cvms").status_code == 403
