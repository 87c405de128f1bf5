"""Credentials only after attestation, against the real Console (SQLite) and simulated TDs.

A Security CVM enrolls with its one-time token and a quote binding a key it generated: the
credential arrives sealed to that key and works. A reused token, a quote of another release, or a
quote binding another key are refused and audited, and issue nothing.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from tests.console.helpers import Server, new_team, start_server
from tests.console.oidc_issuer import LocalIssuer
from umbra.attest.collateral import StaticCollateral
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verifier
from umbra.console.enrollment import hpke_info, report_data
from umbra.console.release import AttestedReleaseVerifier
from umbra.contracts.release import SUITE
from umbra.proxy.policy.bundle import generate_key


@pytest.fixture(scope="module")
def pki() -> SimulatedPki:
    return SimulatedPki.generate()


@pytest.fixture(scope="module")
def console(
    tmp_path_factory: pytest.TempPathFactory, pki: SimulatedPki
) -> Iterator[tuple[Server, LocalIssuer]]:
    issuer = LocalIssuer()
    tmp = tmp_path_factory.mktemp("enroll")
    db = tmp / "console.db"
    server = start_server("sqlite", f"sqlite:///{db}", db, issuer.url, generate_key(), tmp)
    release = SimulatedTdx(pki, image="umbra-security-cvm").release_manifest()
    server.console.release_verifier = AttestedReleaseVerifier(
        Verifier(
            MeasurementPolicy(release=release),
            StaticCollateral(pki.collateral(int(time.time()) - 3600)),
            allow_simulated=True,
            simulated_root_der=pki.root_der,
        )
    )
    yield server, issuer
    server.stop()
    issuer.close()


def _evidence(
    server: Server, token: str, cvm_id: str, td: SimulatedTdx, *, bind_other_key: bool = False
) -> tuple[dict[str, Any], X25519PrivateKey]:
    with server.client() as anonymous:
        challenge = anonymous.post("/api/v1/enroll/challenge", json={"token": token})
    assert challenge.status_code == 200, challenge.text
    nonce = challenge.json()["nonce"]
    key = X25519PrivateKey.generate()
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    bound = X25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    quote = td.quote(report_data(nonce, cvm_id, bound if bind_other_key else raw))
    return {
        "token": token,
        "nonce": nonce,
        "quote": base64.b64encode(quote).decode(),
        "public_key": base64.b64encode(raw).decode(),
    }, key


def _audit_actions(server: Server, team: Any) -> list[tuple[str, dict[str, Any]]]:
    page = team.admin.get(f"/api/v1/teams/{team.name}/audit", params={"limit": 100}).json()
    entries = page["entries"] if isinstance(page, dict) else page
    return [(e["action"], e.get("details", {})) for e in entries]


def test_credential_only_after_attestation_and_tokens_are_single_use(
    console: tuple[Server, LocalIssuer], pki: SimulatedPki, tmp_path: Path
) -> None:
    server, issuer = console
    team = new_team(server, issuer)
    try:
        minted = team.admin.post(f"/api/v1/cvms/{team.scvm_id}/enrollment-token")
        assert minted.status_code == 201, minted.text
        token = minted.json()["token"]
        td = SimulatedTdx(pki, image="umbra-security-cvm")

        body, key = _evidence(server, token, team.scvm_id, td)
        with server.client() as anonymous:
            enrolled = anonymous.post("/api/v1/enroll", json=body)
        assert enrolled.status_code == 200, enrolled.text
        sealed = base64.b64decode(enrolled.json()["sealed_credential"])
        credential = SUITE.decrypt(sealed, key, info=hpke_info(team.scvm_id, body["nonce"]))
        with server.client(credential.decode()) as scvm:
            attachments = scvm.get(f"/api/v1/security-cvms/{team.scvm_id}/attachments")
        assert attachments.status_code == 200, attachments.text
        assert credential not in enrolled.content

        # The same token again: refused, audited, nothing issued.
        with server.client() as anonymous:
            again = anonymous.post("/api/v1/enroll/challenge", json={"token": token})
        assert again.status_code == 403 and "reused_token" in again.text
        actions = _audit_actions(server, team)
        assert ("cvm.enroll", {"kind": "security"}) in actions
        assert ("cvm.enroll_refused", {"reason": "reused_token"}) in actions
    finally:
        team.close()


@pytest.mark.parametrize("attack", ["other_release", "other_key"])
def test_a_quote_of_another_release_or_key_is_refused_and_audited(
    console: tuple[Server, LocalIssuer], pki: SimulatedPki, attack: str
) -> None:
    server, issuer = console
    team = new_team(server, issuer)
    try:
        token = team.admin.post(f"/api/v1/cvms/{team.scvm_id}/enrollment-token").json()["token"]
        image = "umbra-something-else" if attack == "other_release" else "umbra-security-cvm"
        td = SimulatedTdx(pki, image=image)
        body, _key = _evidence(
            server, token, team.scvm_id, td, bind_other_key=attack == "other_key"
        )
        with server.client() as anonymous:
            refused = anonymous.post("/api/v1/enroll", json=body)
        assert refused.status_code == 403 and "attestation_failed" in refused.text
        assert "credential" not in refused.json()
        assert ("cvm.enroll_refused", {"reason": "attestation_failed"}) in _audit_actions(
            server, team
        )
        # The nonce was spent by the failed attempt: replaying the evidence is refused too.
        with server.client() as anonymous:
            replay = anonymous.post("/api/v1/enroll", json=body)
        assert replay.status_code == 403 and "no_challenge" in replay.text
    finally:
        team.close()


def test_a_dev_cvm_is_routed_to_its_teams_security_cvm_by_default(
    console: tuple[Server, LocalIssuer],
) -> None:
    server, issuer = console
    team = new_team(server, issuer)
    try:
        created = team.dev.post(f"/api/v1/teams/{team.name}/cvms", json={"name": "routed"})
        assert created.status_code == 201, created.text
        shown = team.dev.get(f"/api/v1/cvms/{created.json()['id']}").json()
        assert shown["security_cvm_id"] == team.scvm_id  # the developer sees where it routes
    finally:
        team.close()
