"""The structured verdict: each kind of failure names its step, for JSON output and callers."""

from __future__ import annotations

from umbra.attest.collateral import Collateral
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Step, Verdict, verify_quote

from .conftest import T_SIM


def _verify(pki: SimulatedPki, collateral: Collateral, raw: bytes, **release: object) -> Verdict:
    tdx = SimulatedTdx(pki)
    return verify_quote(
        raw,
        policy=MeasurementPolicy(release=tdx.release_manifest(**release)),
        collateral=collateral,
        now=T_SIM,
        allow_simulated=True,
        simulated_root_der=pki.root_der,
        expected_report_data=b"\1" * 64,
    )


def test_each_failure_names_its_step(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx
) -> None:
    good = tdx.quote(b"\1" * 64)
    assert _verify(pki, sim_collateral, good).ok
    sig_at = 48 + 584 + 4  # first byte of the ECDSA signature over header ‖ body
    bad_sig = bytearray(good)
    bad_sig[sig_at] ^= 1
    v = _verify(pki, sim_collateral, bytes(bad_sig))
    assert v.failed_steps == [Step.QUOTE_SIGNATURE]
    v = _verify(pki, sim_collateral, good, mrtd=["00" * 48])
    assert v.failed_steps == [Step.MEASUREMENT]
    v = _verify(pki, sim_collateral, tdx.quote(b"\2" * 64))
    assert v.failed_steps == [Step.BINDING]
    v = _verify(pki, sim_collateral, good[:100])
    assert v.failed_steps == [Step.EVIDENCE]
    v = _verify(pki, sim_collateral, good, tcb={"allowed_statuses": ["OutOfDate"]})
    assert v.failed_steps == [Step.TCB]
    doc = v.to_json()
    assert doc["failures"] == [{"step": "tcb", "reason": v.reasons[0]}]
    assert doc["failed_steps"] == ["tcb"]
