"""Re-enrollment by fresh quote (console/reenrollment.py), on SQLite and PostgreSQL, with
simulated TDs that measure a launch the way the launch agent does: a CVM that enrolled once with
its token gets a fresh credential after a reboot (its credential was on tmpfs, its token is spent)
by quoting the same launch; the old credential stops working; a replayed, foreign or other-launch
quote is refused and audited; a never-enrolled CVM still needs its token.

Each test fails on the code before re-enrollment: the rebooted CVM's client had only the spent
token (`enrollment refused … reused_token`)."""

from __future__ import annotations

import base64
import hashlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from tests.console import enroll
from tests.console.helpers import Team
from umbra.attest.enroll_client import EnrollError, ensure_credential
from umbra.attest.eventlog import dump_dstack_event_log, make_runtime_event
from umbra.attest.launch_binding import launch_binding
from umbra.attest.simulator import SimulatedTdx
from umbra.console.release import AttestedReleaseVerifier
from umbra.contracts.enrollment import (
    launch_binding_sha256,
    renew_report_data,
)

COMPOSE = {"security": "aa" * 32, "dev": "bb" * 32}
IMAGES = {"security": enroll.SECURITY_IMAGE, "dev": enroll.DEV_IMAGE}
KEYS_A, KEYS_B = "11" * 32, "22" * 32
FIREWALL = "33" * 32


def _release_verifier(kind: str) -> AttestedReleaseVerifier:
    """The release pins the compose hash; the CVM id, keys and ruleset are launch-bound (any
    payload in the release: the launch binding pins them per CVM), and the per-boot id too."""
    events: list[dict[str, object]] = [
        {"name": "compose-hash", "payloads": [COMPOSE[kind]]},
        {"name": "umbra.cvm-id"},
    ]
    if kind == "dev":
        events += [
            {"name": "umbra.ssh-authorized-keys"},
            {"name": "umbra.host-firewall"},
            {"name": "umbra.boot-id"},
        ]
    root = enroll.pki()
    release = SimulatedTdx(root, image=IMAGES[kind]).release_manifest(events=events)
    return enroll.release_verifier(release, root)


@pytest.fixture
def measured(team: Team) -> Iterator[Team]:
    """The team's Console verifies enrollments against releases that name the launch events."""
    console = team.server.console
    before = console.enrollment_verifiers
    console.enrollment_verifiers = {k: _release_verifier(k) for k in ("security", "dev")}
    try:
        yield team
    finally:
        console.enrollment_verifiers = before


def boot(kind: str, cvm_id: str, *, keys: str = KEYS_A, image: str | None = None) -> SimulatedTdx:
    """One boot of a CVM: the launch agent's events, then (Dev) this boot's random id."""
    td = SimulatedTdx(enroll.pki(), image=image or IMAGES[kind])
    td.extend_runtime_event("compose-hash", bytes.fromhex(COMPOSE[kind]))
    td.extend_runtime_event("umbra.cvm-id", cvm_id.encode())
    if kind == "dev":
        td.extend_runtime_event("umbra.ssh-authorized-keys", bytes.fromhex(keys))
        td.extend_runtime_event("umbra.host-firewall", bytes.fromhex(FIREWALL))
        td.extend_runtime_event("umbra.boot-id", time.time_ns().to_bytes(16, "big").hex().encode())
    return td


def start(
    url: str, cvm_id: str, td: SimulatedTdx, state: Path, token: Path | None
) -> tuple[str, bool]:
    """What the proxy/forwarder runs at start: its state dir is tmpfs (empty after a reboot)."""
    return ensure_credential(
        console_url=url,
        cvm_id=cvm_id,
        token_file=token,
        credential_file=state / "credential",
        quoter=lambda rd: (td.quote(rd), td.event_log()),
        launch_events=td.event_log(),
    )


def audit_actions(team: Team, target: str) -> list[tuple[str, dict[str, object]]]:
    entries = team.admin.get(f"/api/v1/teams/{team.name}/audit", params={"limit": 200}).json()
    rows = entries["entries"] if isinstance(entries, dict) else entries
    return [(e["action"], e.get("details", {})) for e in rows if e["target"] == target]


def _token(team: Team, cvm_id: str, where: Path) -> Path:
    minted = team.admin.post(f"/api/v1/cvms/{cvm_id}/enrollment-token")
    assert minted.status_code == 201, minted.text
    path = where / "enrollment-token"
    path.write_text(minted.json()["token"])
    return path


def _security_cvm(team: Team) -> str:
    made = team.admin.post(
        f"/api/v1/teams/{team.name}/cvms",
        json={"name": f"s{time.time_ns() % 10**9}", "kind": "security"},
    )
    assert made.status_code == 201, made.text
    return str(made.json()["id"])


def test_a_rebooted_security_cvm_reenrolls_and_its_old_credential_stops_working(
    measured: Team,
) -> None:
    team, url = measured, measured.server.url
    cvm_id = _security_cvm(team)
    with tempfile.TemporaryDirectory() as tmp:
        launch, first, second = (Path(tmp) / d for d in ("launch", "boot1", "boot2"))
        for d in (launch, first, second):
            d.mkdir()
        token = _token(team, cvm_id, launch)
        token_text = token.read_text()
        old, enrolled = start(url, cvm_id, boot("security", cvm_id), first, token)
        assert enrolled
        # The reboot: tmpfs state gone, the launch agent writes the (spent) token again.
        token.write_text(token_text)
        new, renewed = start(url, cvm_id, boot("security", cvm_id), second, token)
        assert renewed and new != old and new.startswith("umbra_scvm_")
    path = f"/api/v1/security-cvms/{cvm_id}/attachments"
    with team.server.client(old) as stale, team.server.client(new) as fresh:
        assert stale.get(path).status_code == 401  # revoked by the renewal
        assert fresh.get(path).status_code == 200
    actions = [a for a, _ in audit_actions(team, cvm_id)]
    assert actions.count("cvm.enroll") == 1 and actions.count("cvm.reenroll") == 1
    assert "cvm.enroll_refused" not in actions  # the spent token was never presented again
    for body in team.server.responses:  # no response carries a credential in clear
        assert old.encode() not in body and new.encode() not in body


def test_a_rebooted_dev_cvm_reenrolls_and_its_security_cvm_learns_the_new_credential(
    measured: Team,
) -> None:
    team, url = measured, measured.server.url
    cvm_id = team.dev_cvm()
    with tempfile.TemporaryDirectory() as tmp:
        token = _token(team, cvm_id, Path(tmp))
        (Path(tmp) / "a").mkdir()
        (Path(tmp) / "b").mkdir()
        old, _ = start(url, cvm_id, boot("dev", cvm_id), Path(tmp) / "a", token)
        # Each boot has its own boot id: not launch-bound, so the renewal still matches.
        new, renewed = start(url, cvm_id, boot("dev", cvm_id), Path(tmp) / "b", None)
    assert renewed and new != old and new.startswith("umbra_tun_")
    doc = team.scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments").json()
    assert doc["cvms"][cvm_id]["credential_sha256"] == hashlib.sha256(new.encode()).hexdigest()


def _renew_body(
    team: Team, cvm_id: str, td: SimulatedTdx, *, hint_from: SimulatedTdx | None = None
) -> tuple[httpx.Response, dict[str, str]]:
    hint = launch_binding_sha256(launch_binding((hint_from or td).event_log()))
    challenge = team.dev.post(
        "/api/v1/enroll/renew/challenge", json={"cvm_id": cvm_id, "launch_sha256": hint}
    )
    assert challenge.status_code == 200, challenge.text
    nonce = challenge.json()["nonce"]
    public = X25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    body = {
        "cvm_id": cvm_id,
        "nonce": nonce,
        "quote": base64.b64encode(td.quote(renew_report_data(nonce, cvm_id, public))).decode(),
        "public_key": base64.b64encode(public).decode(),
        "event_log": base64.b64encode(dump_dstack_event_log(td.event_log()).encode()).decode(),
    }
    return team.dev.post("/api/v1/enroll/renew", json=body), body


def _enrolled_dev(team: Team) -> str:
    cvm_id = team.dev_cvm()
    with tempfile.TemporaryDirectory() as tmp:
        token = _token(team, cvm_id, Path(tmp))
        start(team.server.url, cvm_id, boot("dev", cvm_id), Path(tmp), token)
    return cvm_id


def test_replayed_foreign_and_other_launch_quotes_are_refused_and_audited(measured: Team) -> None:
    team = measured
    cvm_id = _enrolled_dev(team)
    genuine = boot("dev", cvm_id)
    ok, body = _renew_body(team, cvm_id, genuine)
    assert ok.status_code == 200, ok.text
    # The same evidence again: its nonce is spent.
    replay = team.dev.post("/api/v1/enroll/renew", json=body)
    assert replay.status_code == 403 and "no_challenge" in replay.text
    # Another launch of the same CVM id (other SSH keys) claiming this launch's digest.
    other_keys = boot("dev", cvm_id, keys=KEYS_B)
    refused, _ = _renew_body(team, cvm_id, other_keys, hint_from=genuine)
    assert refused.status_code == 403 and "launch_mismatch" in refused.text
    # Another CVM's genuine TD, claiming this CVM (its log carries its own id).
    foreign = boot("dev", "cvm_f0f0f0f0f0f0f0f0")
    refused, _ = _renew_body(team, cvm_id, foreign, hint_from=genuine)
    assert refused.status_code == 403 and "launch_mismatch" in refused.text
    # A TD of another release (the Security image) with this launch.
    wrong_release = boot("dev", cvm_id, image=enroll.SECURITY_IMAGE)
    refused, _ = _renew_body(team, cvm_id, wrong_release)
    assert refused.status_code == 403 and "attestation_failed" in refused.text
    reasons = [
        d.get("reason") for a, d in audit_actions(team, cvm_id) if a == "cvm.reenroll_refused"
    ]
    assert sorted(reasons) == sorted(
        ["no_challenge", "launch_mismatch", "launch_mismatch", "attestation_failed"]
    )
    # None of them disturbed the credential the genuine renewal issued.
    assert [a for a, _ in audit_actions(team, cvm_id)].count("cvm.reenroll") == 1


def test_parallel_renewals_with_one_nonce_issue_one_credential(measured: Team) -> None:
    """The same renewal evidence posted by several clients at once: one credential, the others
    refused (the renewal lock; a nonce is spent by any attempt)."""
    from tests.console.test_races import PARALLEL, race

    team = measured
    cvm_id = _enrolled_dev(team)
    td = boot("dev", cvm_id)
    hint = launch_binding_sha256(launch_binding(td.event_log()))
    nonce = team.dev.post(
        "/api/v1/enroll/renew/challenge", json={"cvm_id": cvm_id, "launch_sha256": hint}
    ).json()["nonce"]
    public = X25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    body = {
        "cvm_id": cvm_id,
        "nonce": nonce,
        "quote": base64.b64encode(td.quote(renew_report_data(nonce, cvm_id, public))).decode(),
        "public_key": base64.b64encode(public).decode(),
        "event_log": base64.b64encode(dump_dstack_event_log(td.event_log()).encode()).decode(),
    }
    pool = [team.server.client() for _ in range(PARALLEL)]
    try:
        responses = race([lambda c=c: c.post("/api/v1/enroll/renew", json=body) for c in pool])  # type: ignore[misc]
    finally:
        for client in pool:
            client.close()
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] + [403] * (PARALLEL - 1), [r.text for r in responses]


def test_a_never_enrolled_cvm_needs_its_token(measured: Team) -> None:
    team = measured
    cvm_id = team.dev_cvm()
    td = boot("dev", cvm_id)
    hint = launch_binding_sha256(launch_binding(td.event_log()))
    answer = team.dev.post(
        "/api/v1/enroll/renew/challenge", json={"cvm_id": cvm_id, "launch_sha256": hint}
    )
    assert answer.status_code == 409 and "not_enrolled" in answer.text
    with (
        tempfile.TemporaryDirectory() as tmp,
        pytest.raises(EnrollError, match="no enrollment token"),
    ):
        start(team.server.url, cvm_id, td, Path(tmp), None)


def test_a_relaunch_with_new_launch_data_spends_its_new_token_and_retires_the_old_launch(
    measured: Team,
) -> None:
    team, url = measured, measured.server.url
    cvm_id = _enrolled_dev(team)
    with tempfile.TemporaryDirectory() as tmp:
        # The Console updated the CVM's keys: a new VM, new launch data with a fresh token.
        token = _token(team, cvm_id, Path(tmp))
        _, enrolled = start(url, cvm_id, boot("dev", cvm_id, keys=KEYS_B), Path(tmp), token)
    assert enrolled
    actions = [a for a, _ in audit_actions(team, cvm_id)]
    assert actions.count("cvm.enroll") == 2 and "cvm.reenroll_refused" not in actions
    # The old launch can no longer renew: the challenge sends it to a token it does not have.
    old = boot("dev", cvm_id, keys=KEYS_A)
    hint = launch_binding_sha256(launch_binding(old.event_log()))
    answer = team.dev.post(
        "/api/v1/enroll/renew/challenge", json={"cvm_id": cvm_id, "launch_sha256": hint}
    )
    assert answer.status_code == 409


def test_the_launch_binding_names_the_launch_agents_events() -> None:
    from umbra.attest.measurement import COMPOSE_HASH_EVENT, SSH_KEYS_EVENT
    from umbra.contracts.enrollment import LAUNCH_BOUND_EVENTS
    from umbra.contracts.session import CVM_ID_EVENT, HOST_FIREWALL_EVENT
    from umbra.images.measure import boot_events

    assert LAUNCH_BOUND_EVENTS == (
        COMPOSE_HASH_EVENT,
        CVM_ID_EVENT,
        SSH_KEYS_EVENT,
        HOST_FIREWALL_EVENT,
    )
    per_boot = {e.name for e in boot_events("dev-cvm", "00" * 16, _HOST_KEY)}
    assert per_boot.isdisjoint(LAUNCH_BOUND_EVENTS)
    with pytest.raises(ValueError, match=r"umbra\.cvm-id"):
        launch_binding([make_runtime_event(3, "compose-hash", b"x")])


_HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
