"""The simulated TEE: same verifier, other root; accepted only on double opt-in, marked simulated."""

from __future__ import annotations

from pathlib import Path

import pytest

from umbra.attest.collateral import Collateral
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import verify_quote

from .conftest import T_SIM


@pytest.mark.parametrize("version", [4, 5])
def test_simulated_quote_verifies_with_double_opt_in(
    pki: SimulatedPki, sim_collateral: Collateral, version: int
) -> None:
    tdx = SimulatedTdx(pki, version=version)
    policy = MeasurementPolicy(release=tdx.release_manifest())
    v = verify_quote(
        tdx.quote(b"nonce"),
        policy=policy,
        collateral=sim_collateral,
        now=T_SIM,
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    assert v.ok, v.reasons
    assert v.simulated
    assert v.tcb_status == "UpToDate"
    assert v.to_json()["simulated"] is True


def test_default_verifier_refuses_simulated_quotes(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx
) -> None:
    raw = tdx.quote(b"")
    sim_policy = MeasurementPolicy(release=tdx.release_manifest())
    # Policy says simulated, caller did not opt in.
    v = verify_quote(raw, policy=sim_policy, collateral=sim_collateral, now=T_SIM)
    assert not v.ok
    assert "not allowed by the caller" in v.reasons[0]
    # Caller opts in, but the policy is a production (tdx) one: Intel's root is the anchor.
    tdx_policy = MeasurementPolicy(release=tdx.release_manifest().model_copy(update={"tee": "tdx"}))
    v = verify_quote(
        raw,
        policy=tdx_policy,
        collateral=sim_collateral,
        now=T_SIM,
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    assert not v.ok
    assert not v.simulated
    assert any("Intel SGX Root CA" in r for r in v.reasons)
    # The simulated collateral does not chain to Intel's root either (collateral_check.py).
    assert any("does not end in the pinned root CA" in r for r in v.reasons)


def test_another_simulated_root_is_refused(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx
) -> None:
    other = SimulatedPki.generate()
    v = verify_quote(
        tdx.quote(b""),
        policy=MeasurementPolicy(release=tdx.release_manifest()),
        collateral=sim_collateral,
        now=T_SIM,
        allow_simulated=True,
        simulated_root_der=other.root_der,
    )
    assert not v.ok


def test_simulated_pki_persists(tmp_path: Path) -> None:
    a = SimulatedPki.load_or_create(tmp_path / "pki")
    b = SimulatedPki.load_or_create(tmp_path / "pki")
    assert a.root_der == b.root_der
    assert (tmp_path / "pki" / "root.key").stat().st_mode & 0o077 == 0
    tdx = SimulatedTdx(b)
    v = verify_quote(
        tdx.quote(b""),
        policy=MeasurementPolicy(release=tdx.release_manifest()),
        collateral=a.collateral(T_SIM - 60),
        now=T_SIM,
        allow_simulated=True,
        simulated_root_der=a.root_der,
    )
    assert v.ok, v.reasons


def test_simulated_collateral_expires(pki: SimulatedPki, tdx: SimulatedTdx) -> None:
    collateral = pki.collateral(T_SIM - 31 * 86400)
    v = verify_quote(
        tdx.quote(b""),
        policy=MeasurementPolicy(release=tdx.release_manifest()),
        collateral=collateral,
        now=T_SIM,
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    assert not v.ok
