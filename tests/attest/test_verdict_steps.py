"""The structured verdict: each kind of failure names its step, for JSON output and callers."""

from __future__ import annotations

import json

from umbra.attest.collateral import Collateral
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpki import SimulatedPki, raw_signature
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import DEBUG_TD, Step, Verdict, verify_quote

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


def _resigned(
    pki: SimulatedPki, collateral: Collateral, part: str, **changes: object
) -> Collateral:
    """The simulated collateral with `part` (tcb_info / qe_identity) edited and signed again by
    the TCB-signing key: genuine-looking collateral that does not fit the quote."""
    doc = json.loads(collateral.json_text)
    inner = json.loads(doc[part]) | changes
    doc[part] = json.dumps(inner, separators=(",", ":"))
    doc[f"{part}_signature"] = raw_signature(pki.tcb_signing_key, doc[part].encode()).hex()
    return Collateral.from_json(json.dumps(doc))


def test_fmspc_qe_identity_and_debug_have_their_own_steps(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx
) -> None:
    """They used to land in quote_signature, as if a signature were broken (issue 24)."""
    good = tdx.quote(b"\1" * 64)
    other_fmspc = _resigned(pki, sim_collateral, "tcb_info", fmspc="00906ED50000")
    v = _verify(pki, other_fmspc, good)
    assert v.failed_steps == [Step.FMSPC], v.failures
    assert "Fmspc mismatch" in v.reasons[0]
    sgx_qe = _resigned(pki, sim_collateral, "qe_identity", id="QE")
    v = _verify(pki, sgx_qe, good)
    assert v.failed_steps == [Step.QE_IDENTITY], v.failures
    assert "Unsupported QE Identity" in v.reasons[0]
    debug = SimulatedTdx(pki, debug=True).quote(b"\1" * 64)
    v = _verify(pki, sim_collateral, debug, td={"attributes": {"value": 0, "mask": 0}})
    assert v.failed_steps == [Step.DEBUG], v.failures
    assert [f.reason for f in v.failures][-1] == DEBUG_TD  # ours, beside dcap-qvl's
    assert any("Debug mode" in r for r in v.reasons)


def test_the_step_follows_dcap_qvl_s_text_not_the_cause_appended_to_it() -> None:
    from umbra.attest.verify import _dcap_step

    chain = "DCAP verification failed: Failed to verify certificate chain"
    expired = chain + " (cause: a certificate has expired (time: …, not_after: …))"
    assert _dcap_step(expired, None) is Step.QUOTE_SIGNATURE  # "expired" is the cause's word
    assert _dcap_step("DCAP verification failed: TCBInfo expired", None) is Step.COLLATERAL
