"""Attested secret release: only to a Security CVM whose (simulated) TDX quote verifies and binds
the nonce, its id and an X25519 key; the values travel HPKE-sealed to that key."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from tests.console.helpers import CaptureHandler, Server, Team
from tests.console.test_secrets import database_bytes, encodings
from umbra.attest.collateral import StaticCollateral
from umbra.attest.eventlog import dump_dstack_event_log
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verifier
from umbra.console.config import ConfigError
from umbra.console.release import (
    SUITE,
    AttestedReleaseVerifier,
    expected_report_data,
    hpke_info,
)
from umbra.console.release_config import verifier_from_settings


@pytest.fixture(scope="module")
def pki() -> SimulatedPki:
    return SimulatedPki.generate()


@pytest.fixture
def attested(server: Server, pki: SimulatedPki) -> Iterator[SimulatedTdx]:
    tdx = SimulatedTdx(pki, image="umbra-security-cvm")
    verifier = Verifier(
        MeasurementPolicy(release=tdx.release_manifest()),
        StaticCollateral(pki.collateral(int(time.time()) - 3600)),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    previous = server.console.release_verifier
    server.console.release_verifier = AttestedReleaseVerifier(verifier)
    yield tdx
    server.console.release_verifier = previous


def _evidence(
    team: Team, tdx: SimulatedTdx, key: X25519PrivateKey, **override: Any
) -> dict[str, Any]:
    nonce = team.scvm.post(f"/api/v1/security-cvms/{team.scvm_id}/release-challenge").json()[
        "nonce"
    ]
    public = key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    bound_id = override.pop("bound_id", team.scvm_id)
    report_data = expected_report_data(nonce, bound_id, public)
    evidence = {
        "nonce": nonce,
        "quote": base64.b64encode(tdx.quote(report_data)).decode(),
        "event_log": base64.b64encode(dump_dstack_event_log(tdx.event_log()).encode()).decode(),
        "public_key": base64.b64encode(public).decode(),
    }
    evidence.update(override)
    return evidence


def test_release_to_an_attested_security_cvm(
    server: Server,
    team: Team,
    attested: SimulatedTdx,
    log_capture: CaptureHandler,
    request: pytest.FixtureRequest,
) -> None:
    base = f"/api/v1/teams/{team.name}"
    team.admin.put(
        f"{base}/secrets/bot", json={"value": "team-value", "hosts": ["api.example.com"]}
    )
    team.dev_cvm()  # the developer's Dev CVM routes through this Security CVM
    team.dev.put(
        f"{base}/personal-secrets/gh", json={"value": "dev-value", "hosts": ["github.com"]}
    )
    # A personal secret of someone with no CVM behind this Security CVM is not released.
    team.admin.put(
        f"{base}/personal-secrets/gh", json={"value": "admin-value", "hosts": ["github.com"]}
    )
    key = X25519PrivateKey.generate()
    evidence = _evidence(team, attested, key)
    url = f"/api/v1/security-cvms/{team.scvm_id}/secrets/release"
    response = team.scvm.post(url, json=evidence)
    assert response.status_code == 200, response.text
    body = response.json()
    assert b"team-value" not in response.content and b"dev-value" not in response.content
    assert body["count"] == 2
    info = base64.b64decode(body["info"])
    assert info == hpke_info(team.scvm_id, evidence["nonce"])
    document = json.loads(SUITE.decrypt(base64.b64decode(body["sealed"]), key, info=info))
    released = {
        (item["ref"], item["owner"]): (base64.b64decode(item["value"]), item["hosts"])
        for item in document["secrets"]
    }
    assert released == {
        ("team/bot", None): (b"team-value", ["api.example.com"]),
        ("personal/gh", team.dev_subject): (b"dev-value", ["github.com"]),
    }
    # The nonce was single use.
    replay = team.scvm.post(url, json=evidence)
    assert replay.status_code == 403
    assert "nonce" in replay.json()["detail"]
    audit = team.admin.get(f"{base}/audit").json()["entries"]
    assert audit[-1]["action"] == "secret.release"
    # Released, yet still in no response, log line or database byte in plaintext.
    responses = b"\n".join(server.responses)
    logs = log_capture.text().encode()
    database = list(database_bytes(server, request))
    for value in ("team-value", "dev-value", "admin-value"):
        for form in encodings(value):
            assert form not in responses
            assert form not in logs
            assert all(form not in chunk for chunk in database)


def test_release_refuses_evidence_that_does_not_bind(team: Team, attested: SimulatedTdx) -> None:
    url = f"/api/v1/security-cvms/{team.scvm_id}/secrets/release"
    key = X25519PrivateKey.generate()
    # Quote bound to another CVM id.
    wrong = team.scvm.post(
        url, json=_evidence(team, attested, key, bound_id="cvm_0000000000000000")
    )
    assert wrong.status_code == 403
    assert "report_data does not match" in wrong.json()["detail"]
    # A different key than the one in the quote.
    other = (
        X25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )
    swapped = _evidence(team, attested, key, public_key=base64.b64encode(other).decode())
    assert team.scvm.post(url, json=swapped).status_code == 403
    # A debug TD never gets secrets.
    debug_tdx = SimulatedTdx(attested.pki, image="umbra-security-cvm", debug=True)
    assert team.scvm.post(url, json=_evidence(team, debug_tdx, key)).status_code == 403
    # Garbage quote, malformed key.
    assert team.scvm.post(url, json=_evidence(team, attested, key, quote="AAAA")).status_code == 403
    assert (
        team.scvm.post(url, json=_evidence(team, attested, key, public_key="AAAA")).status_code
        == 403
    )


def test_release_unconfigured_fails_closed(server: Server, team: Team) -> None:
    previous = server.console.release_verifier
    server.console.release_verifier = None
    try:
        response = team.scvm.post(
            f"/api/v1/security-cvms/{team.scvm_id}/secrets/release",
            json={"nonce": "A" * 43, "quote": "AA==", "public_key": "A" * 43 + "="},
        )
    finally:
        server.console.release_verifier = previous
    assert response.status_code == 503


def test_verifier_built_from_settings(
    server: Server, team: Team, pki: SimulatedPki, tmp_path: Path
) -> None:
    tdx = SimulatedTdx(pki, image="umbra-security-cvm")
    (tmp_path / "release.yaml").write_text(
        yaml.safe_dump(tdx.release_manifest().model_dump(mode="json"))
    )
    (tmp_path / "collateral.json").write_text(pki.collateral(int(time.time()) - 60).json_text)
    (tmp_path / "root.der").write_bytes(pki.root_der)
    settings = server.settings.model_copy(
        update={
            "release_policy": tmp_path / "release.yaml",
            "release_collateral": tmp_path / "collateral.json",
            "release_allow_simulated": True,
            "release_simulated_root": tmp_path / "root.der",
        }
    )
    verifier = verifier_from_settings(settings)
    assert verifier is not None
    previous = server.console.release_verifier
    server.console.release_verifier = verifier
    try:
        url = f"/api/v1/security-cvms/{team.scvm_id}/secrets/release"
        key = X25519PrivateKey.generate()
        assert team.scvm.post(url, json=_evidence(team, tdx, key)).status_code == 200
    finally:
        server.console.release_verifier = previous
    # Without the caller's opt-in, simulated quotes are refused (production default).
    strict = verifier_from_settings(settings.model_copy(update={"release_allow_simulated": False}))
    server.console.release_verifier = strict
    try:
        response = team.scvm.post(url, json=_evidence(team, tdx, X25519PrivateKey.generate()))
        assert response.status_code == 403
        assert "not allowed by the caller" in response.json()["detail"]
    finally:
        server.console.release_verifier = previous
    with pytest.raises(ConfigError, match="collateral needed"):
        verifier_from_settings(settings.model_copy(update={"release_collateral": None}))
    with pytest.raises(ConfigError, match="release"):
        verifier_from_settings(settings.model_copy(update={"release_policy": tmp_path / "nope"}))
