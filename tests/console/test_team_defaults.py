"""Team default profiles: set by admins, checked against the bundle, attached by the Console to
every Dev CVM it launches (audited), visible to the developer who owns the CVM."""

from __future__ import annotations

from tests.console.helpers import Team, make_bundle, profile


def test_defaults_are_attached_at_launch_and_audited(team: Team) -> None:
    url = f"/api/v1/teams/{team.name}/default-profiles"
    empty = team.admin.get(url).json()
    assert (empty["profiles"], empty["updated_by"]) == ([], None)
    # No bundle yet: nothing to check the profiles against.
    assert team.admin.put(url, json={"profiles": ["github"]}).status_code == 409
    team.upload(1)
    assert team.admin.put(url, json={"profiles": ["nope"]}).status_code == 422
    assert team.admin.put(url, json={"profiles": ["clash-a", "clash-b"]}).status_code == 422
    stale = team.admin.put(url, json={"profiles": ["web"]}, headers={"If-Match": '"x"'})
    assert stale.status_code == 412
    before = team.dev_cvm()  # launched with no defaults
    put = team.admin.put(
        url, json={"profiles": ["web", "github", "web"]}, headers={"If-Match": empty["etag"]}
    )
    assert put.status_code == 200, put.text
    assert (put.json()["profiles"], put.json()["updated_by"]) == (
        ["github", "web"],
        team.admin_subject,
    )
    read = team.admin.get(url).json()
    assert (read["profiles"], read["etag"]) == (["github", "web"], put.json()["etag"])
    assert team.dev.get(url).status_code == 403  # admins only
    assert team.dev.put(url, json={"profiles": []}).status_code == 403

    cvm_id = team.dev_cvm()
    # The developer sees which Security CVM their CVM goes through and which profiles it has.
    mine = team.dev.get(f"/api/v1/cvms/{cvm_id}").json()
    assert (mine["security_cvm_id"], mine["profiles"]) == (team.scvm_id, ["github", "web"])
    assert team.dev.get(f"/api/v1/cvms/{before}").json()["profiles"] == []  # not retroactive
    document = team.scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments").json()
    assert document["cvms"][cvm_id]["profiles"] == ["github", "web"]
    # Security CVMs get no profiles.
    scvm = team.admin.post(
        f"/api/v1/teams/{team.name}/cvms", json={"name": "sec2", "kind": "security"}
    ).json()
    assert scvm["profiles"] == []

    entries = team.admin.get(f"/api/v1/teams/{team.name}/audit?limit=1000").json()["entries"]
    actions = [(e["action"], e["target"], e["details"]) for e in entries]
    assert (
        "profiles.attach",
        cvm_id,
        {"profiles": ["github", "web"], "source": "team-default"},
    ) in (actions)
    assert (
        "profiles.defaults",
        team.name,
        {"profiles": ["github", "web"], "previous": []},
    ) in actions


def test_bundle_must_keep_the_defaults_composable(team: Team) -> None:
    team.upload(1)
    url = f"/api/v1/teams/{team.name}/default-profiles"
    assert team.admin.put(url, json={"profiles": ["web"]}).status_code == 200
    without_web = make_bundle(team.server.bundle_key, 2, [profile("github", hosts=["github.com"])])
    refused = team.upload(2, without_web)
    assert refused.status_code == 409 and "default profiles" in refused.text
    assert team.admin.put(url, json={"profiles": []}).status_code == 200
    assert team.upload(2, without_web).status_code == 201
