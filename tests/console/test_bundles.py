"""Policy bundles: verification on upload, serial order, ETag/304, and long polls that converge
within a second for both the bundle and the attachment set."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from tests.console.helpers import Team, make_bundle, profile, standard_bundle
from umbra.policy.bundle import generate_key


def test_upload_refuses_unsigned_untrusted_and_garbage(team: Team) -> None:
    untrusted = standard_bundle(generate_key(), 1)
    response = team.upload(1, untrusted)
    assert response.status_code == 422
    assert "not signed by any pinned key" in response.json()["detail"]
    garbage = team.upload(1, b"{not json")
    assert garbage.status_code == 422
    assert garbage.json()["detail"].startswith("bundle: not a signed bundle")
    assert team.upload(1, b"").status_code == 422


def test_serials_only_go_up(team: Team) -> None:
    first = team.upload(5)
    assert first.status_code == 201
    body = first.json()
    assert body["serial"] == 5
    assert body["profiles"] == ["clash-a", "clash-b", "github", "web"]
    assert body["hash"].startswith("sha256:")
    different = make_bundle(team.server.bundle_key, 5, [profile("web", hosts=["example.com"])])
    assert team.upload(5, different).status_code == 409
    lower = team.upload(4)
    assert lower.status_code == 409
    assert "not above the current serial 5" in lower.json()["detail"]
    assert team.upload(6).status_code == 201
    listed = team.dev.get(f"/api/v1/teams/{team.name}/bundles").json()
    assert [item["serial"] for item in listed] == [6, 5]


def test_same_bundle_again_is_idempotent(team: Team) -> None:
    raw = standard_bundle(team.server.bundle_key, 3)
    assert team.upload(3, raw).status_code == 201
    again = team.upload(3, raw)
    assert again.status_code == 200
    assert again.json()["serial"] == 3


def test_bundle_etag_and_304(team: Team) -> None:
    url = f"/api/v1/security-cvms/{team.scvm_id}/bundle"
    assert team.scvm.get(url).status_code == 404
    raw = standard_bundle(team.server.bundle_key, 1)
    info = team.upload(1, raw).json()
    response = team.scvm.get(url)
    assert response.status_code == 200
    assert response.content == raw
    assert response.headers["etag"] == f'"{info["hash"]}"'
    assert response.headers["x-umbra-bundle-serial"] == "1"
    cached = team.scvm.get(url, headers={"If-None-Match": response.headers["etag"]})
    assert cached.status_code == 304
    assert cached.content == b""


def _in_thread(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        result["response"] = call()
        result["at"] = time.monotonic()
        result["took"] = result["at"] - started

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_bundle_long_poll_returns_within_a_second_of_upload(team: Team) -> None:
    team.upload(1)
    url = f"/api/v1/security-cvms/{team.scvm_id}/bundle"
    etag = team.scvm.get(url).headers["etag"]
    with httpx.Client(base_url=team.server.url, headers=team.scvm.headers, timeout=30) as poller:
        thread, result = _in_thread(
            lambda: poller.get(url, params={"wait": 20}, headers={"If-None-Match": etag})
        )
        time.sleep(0.5)
        uploaded_at = time.monotonic()
        assert team.upload(2).status_code == 201
        thread.join(timeout=25)
    assert result["response"].status_code == 200
    assert result["response"].headers["x-umbra-bundle-serial"] == "2"
    assert result["at"] - uploaded_at < 1.0


def test_bundle_long_poll_waits_for_the_first_upload(team: Team) -> None:
    """No bundle yet is not an answer: the poll waits, and the first upload answers it."""
    url = f"/api/v1/security-cvms/{team.scvm_id}/bundle"
    assert team.scvm.get(url).status_code == 404
    with httpx.Client(base_url=team.server.url, headers=team.scvm.headers, timeout=30) as poller:
        thread, result = _in_thread(lambda: poller.get(url, params={"wait": 20}))
        time.sleep(0.5)
        uploaded_at = time.monotonic()
        assert team.upload(1).status_code == 201
        thread.join(timeout=25)
    assert result["response"].status_code == 200
    assert result["response"].headers["x-umbra-bundle-serial"] == "1"
    assert result["at"] - uploaded_at < 1.0


def test_long_poll_times_out_with_304(team: Team) -> None:
    team.upload(1)
    url = f"/api/v1/security-cvms/{team.scvm_id}/bundle"
    etag = team.scvm.get(url).headers["etag"]
    started = time.monotonic()
    response = team.scvm.get(url, params={"wait": 1}, headers={"If-None-Match": etag})
    assert response.status_code == 304
    assert 0.9 < time.monotonic() - started < 5


def test_attachments_document_etag_and_long_poll(team: Team) -> None:
    team.upload(1)
    cvm = team.dev_cvm()
    url = f"/api/v1/security-cvms/{team.scvm_id}/attachments"
    first = team.scvm.get(url)
    assert first.status_code == 200
    assert first.json() == {
        "cvms": {
            cvm: {
                "owner": team.dev_subject,
                "team": team.name,
                "profiles": [],
                "credential_sha256": None,  # not enrolled yet: the tunnel refuses it
            }
        }
    }
    etag = first.headers["etag"]
    assert team.scvm.get(url, headers={"If-None-Match": etag}).status_code == 304
    with httpx.Client(base_url=team.server.url, headers=team.scvm.headers, timeout=30) as poller:
        thread, result = _in_thread(
            lambda: poller.get(url, params={"wait": 20}, headers={"If-None-Match": etag})
        )
        time.sleep(0.5)
        attached_at = time.monotonic()
        attach = team.admin.put(
            f"/api/v1/cvms/{cvm}/profiles", json={"profiles": ["web", "github"]}
        )
        assert attach.status_code == 200, attach.text
        thread.join(timeout=25)
    response = result["response"]
    assert response.status_code == 200
    assert response.json()["cvms"][cvm]["profiles"] == ["github", "web"]
    assert response.headers["etag"] != etag
    assert result["at"] - attached_at < 1.0


def test_attach_checks_the_current_bundle(team: Team) -> None:
    cvm = team.dev_cvm()
    url = f"/api/v1/cvms/{cvm}/profiles"
    no_bundle = team.admin.put(url, json={"profiles": ["github"]})
    assert no_bundle.status_code == 409
    team.upload(1)
    unknown = team.admin.put(url, json={"profiles": ["nope"]})
    assert unknown.status_code == 422
    assert "no profile named nope" in unknown.json()["detail"]
    clash = team.admin.put(url, json={"profiles": ["clash-a", "clash-b"]})
    assert clash.status_code == 422
    assert "do not compose" in clash.json()["detail"]
    assert team.admin.put(url, json={"profiles": ["github"]}).status_code == 200
    assert team.admin.put(url, json={"profiles": []}).status_code == 200


def test_new_bundle_must_keep_attachments_composable(team: Team) -> None:
    team.upload(1)
    cvm = team.dev_cvm()
    assert (
        team.admin.put(f"/api/v1/cvms/{cvm}/profiles", json={"profiles": ["github"]}).status_code
        == 200
    )
    without_github = make_bundle(team.server.bundle_key, 2, [profile("web", hosts=["example.com"])])
    refused = team.upload(2, without_github)
    assert refused.status_code == 409
    assert cvm in refused.json()["detail"]


def test_a_long_poll_ends_when_its_caller_leaves(team: Team) -> None:
    """A stopped Security CVM's poll must not hold the Console (its graceful shutdown waits for
    in-flight requests): the wait ends once the client has disconnected."""
    url = f"/api/v1/security-cvms/{team.scvm_id}/attachments"
    etag = team.scvm.get(url).headers["ETag"]
    gauge = team.server.console.metrics.long_polls
    before = gauge._value.get()
    token = team.scvm.headers["Authorization"]
    with (
        httpx.Client(base_url=team.server.url, headers={"Authorization": token}) as leaving,
        pytest.raises(httpx.ReadTimeout),
    ):
        leaving.get(url, params={"wait": 30}, headers={"If-None-Match": etag}, timeout=1.0)
    deadline = time.monotonic() + 5
    while gauge._value.get() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gauge._value.get() == before, "the poll kept waiting after its caller left"
