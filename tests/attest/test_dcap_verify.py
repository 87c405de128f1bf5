"""DCAP verification of the real Intel-signed vectors, bit flips, and our TCB policy."""

from __future__ import annotations

import hashlib
import random

import pytest

from umbra.attest.collateral import Collateral
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.tcb import MaskedValue, TcbPolicy, TdPolicy
from umbra.attest.verify import Step, Verdict, verify_quote

from .conftest import T_INSIDE, T_SIM, release_for


def test_real_quote_verifies_up_to_date_inside_window(
    real_quote: bytes, real_collateral: Collateral, real_policy: MeasurementPolicy
) -> None:
    v = verify_quote(real_quote, policy=real_policy, collateral=real_collateral, now=T_INSIDE)
    assert v.ok, v.reasons
    assert v.tcb_status == "UpToDate"
    assert not v.simulated


@pytest.mark.parametrize(
    "when",
    [
        T_INSIDE + 2,  # the PCK CRL / TCB info has expired
        T_INSIDE + 86_400 * 365,
        1_750_000_000,  # before the TCB info and QE identity were issued
    ],
)
def test_real_quote_fails_outside_collateral_window(
    real_quote: bytes, real_collateral: Collateral, real_policy: MeasurementPolicy, when: int
) -> None:
    v = verify_quote(real_quote, policy=real_policy, collateral=real_collateral, now=when)
    assert not v.ok
    if when > T_INSIDE:  # said plainly, before dcap-qvl is asked
        assert v.reasons == ["collateral expired at 2025-07-19T10:00:35Z"]
        assert v.failed_steps == [Step.COLLATERAL]
    else:
        assert any("DCAP verification failed" in r for r in v.reasons)
        assert v.failed_steps == [Step.COLLATERAL]  # issued after "now"


def test_outdated_vector_fails(outdated_quote: bytes, outdated_collateral: Collateral) -> None:
    policy = MeasurementPolicy(release=release_for(outdated_quote))
    now = outdated_collateral.issue_date + 3600
    v = verify_quote(outdated_quote, policy=policy, collateral=outdated_collateral, now=now)
    assert not v.ok
    assert any("No matching TCB level" in r for r in v.reasons)


def test_single_bit_flips_anywhere_fail(
    real_quote: bytes, real_collateral: Collateral, real_policy: MeasurementPolicy
) -> None:
    rng = random.Random(20250719)
    n_bits = len(real_quote) * 8
    # Every byte of the header and TD report, plus a random sample across the signature data,
    # the embedded PEM chain (including the root certificate) and the zero padding.
    positions = [8 * i + rng.randrange(8) for i in range(632)]
    positions += rng.sample(range(632 * 8, n_bits), 900)
    passed = []
    for bit in positions:
        flipped = bytearray(real_quote)
        flipped[bit // 8] ^= 1 << (bit % 8)
        v = verify_quote(
            bytes(flipped), policy=real_policy, collateral=real_collateral, now=T_INSIDE
        )
        if v.ok:
            passed.append(bit)
    assert passed == []


def test_root_in_chain_must_be_the_pinned_root(
    real_quote: bytes, real_collateral: Collateral, real_policy: MeasurementPolicy
) -> None:
    # Flip a bit inside the root certificate's signature: dcap-qvl ignores that copy of the
    # root, so only our pin catches it.
    end = real_quote.index(b"-----END CERTIFICATE-----\n\x00")
    pos = end - 10
    flipped = bytearray(real_quote)
    flipped[pos] ^= 0x01
    v = verify_quote(bytes(flipped), policy=real_policy, collateral=real_collateral, now=T_INSIDE)
    assert not v.ok


def _verify_sim(
    raw: bytes,
    pki: SimulatedPki,
    collateral: Collateral,
    tdx: SimulatedTdx,
    now: int = T_SIM,
    **release: object,
) -> Verdict:
    policy = MeasurementPolicy(release=tdx.release_manifest(**release))
    return verify_quote(
        raw,
        policy=policy,
        collateral=collateral,
        now=now,
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )


def test_tcb_status_allowlist(real_quote: bytes, real_collateral: Collateral) -> None:
    policy = MeasurementPolicy(
        release=release_for(real_quote, tcb={"allowed_statuses": ["SWHardeningNeeded"]})
    )
    v = verify_quote(real_quote, policy=policy, collateral=real_collateral, now=T_INSIDE)
    assert not v.ok
    assert any("TCB status UpToDate is not allowed" in r for r in v.reasons)


def test_out_of_date_refused_by_default_and_grace_period(pki: SimulatedPki) -> None:
    collateral = pki.collateral(T_SIM - 3600, tcb_status="OutOfDate")
    tdx = SimulatedTdx(pki)
    raw = tdx.quote(b"")
    v = _verify_sim(raw, pki, collateral, tdx)
    assert not v.ok
    assert v.tcb_status == "OutOfDate"
    assert any("OutOfDate is not allowed" in r for r in v.reasons)
    # The simulated OutOfDate level is dated 2024-03-13; a grace period that ends before now
    # fails, one that reaches past now passes (the advisory must be allowed too).
    level_date = 1710288000
    ok_grace = T_SIM - level_date + 60
    tcb = {
        "allowed_statuses": ["UpToDate", "OutOfDate"],
        "allowed_advisories": ["INTEL-SA-00960"],
    }
    short = _verify_sim(
        raw, pki, collateral, tdx, tcb={**tcb, "out_of_date_grace_seconds": ok_grace - 120}
    )
    assert not short.ok
    assert any("grace" in r for r in short.reasons)
    long = _verify_sim(
        raw, pki, collateral, tdx, tcb={**tcb, "out_of_date_grace_seconds": ok_grace}
    )
    assert long.ok, long.reasons


def test_advisory_allowlist_defaults_to_none(pki: SimulatedPki) -> None:
    collateral = pki.collateral(T_SIM - 3600, tcb_status="SWHardeningNeeded")
    tdx = SimulatedTdx(pki)
    raw = tdx.quote(b"")
    statuses = {"allowed_statuses": ["SWHardeningNeeded"]}
    v = _verify_sim(raw, pki, collateral, tdx, tcb=statuses)
    assert not v.ok
    assert v.reasons == ["advisories not in the allowlist: INTEL-SA-00960"]
    v = _verify_sim(
        raw, pki, collateral, tdx, tcb={**statuses, "allowed_advisories": ["intel-sa-00960"]}
    )
    assert v.ok, v.reasons


def test_max_collateral_age(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx
) -> None:
    raw = tdx.quote(b"")
    assert _verify_sim(raw, pki, sim_collateral, tdx).ok
    v = _verify_sim(raw, pki, sim_collateral, tdx, tcb={"max_collateral_age_seconds": 1800})
    assert not v.ok
    assert any("older than the 1800s allowed" in r for r in v.reasons)


def test_debug_td_is_never_accepted(pki: SimulatedPki, sim_collateral: Collateral) -> None:
    tdx = SimulatedTdx(pki, debug=True)
    # Even a policy whose attribute mask leaves the DEBUG bit free refuses it.
    v = _verify_sim(
        tdx.quote(b""), pki, sim_collateral, tdx, td={"attributes": {"value": 0, "mask": 0}}
    )
    assert not v.ok
    assert any("debug TD" in r for r in v.reasons)


def test_td_attributes_and_xfam_value_mask(
    pki: SimulatedPki, sim_collateral: Collateral, tdx: SimulatedTdx
) -> None:
    raw = tdx.quote(b"")
    ok = TdPolicy(
        attributes=MaskedValue(value=1 << 28, mask=(1 << 28) | 1),
        xfam=MaskedValue(value=tdx.xfam, mask=(1 << 64) - 1),
    )
    assert _verify_sim(raw, pki, sim_collateral, tdx, td=ok.model_dump()).ok
    bad = {
        "attributes": {"value": 0, "mask": (1 << 28) | 1},
        "xfam": {"value": "0x3", "mask": "0xff"},
    }
    v = _verify_sim(raw, pki, sim_collateral, tdx, td=bad)
    assert not v.ok
    assert any(r.startswith("TD attributes") for r in v.reasons)
    assert any(r.startswith("XFAM") for r in v.reasons)


def test_every_failed_check_is_reported(pki: SimulatedPki, sim_collateral: Collateral) -> None:
    tdx = SimulatedTdx(pki)
    raw = tdx.quote(b"")
    policy = MeasurementPolicy(
        release=tdx.release_manifest(
            mrtd=["00" * 48],
            rtmr1=["11" * 48],
            tcb={"allowed_statuses": ["SWHardeningNeeded"]},
            td={"xfam": {"value": 0, "mask": 1}},
        )
    )
    v = verify_quote(
        raw,
        policy=policy,
        collateral=sim_collateral,
        now=T_SIM,
        allow_simulated=True,
        simulated_root_der=pki.root_der,
        expected_report_data=b"\x01" * 64,
    )
    text = "\n".join(v.reasons)
    for needle in ("TCB status", "XFAM", "MRTD", "RTMR1", "report_data"):
        assert needle in text
    assert "RTMR0" not in text


def test_policy_model_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="Revoked"):
        TcbPolicy(allowed_statuses=["Revoked"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="OutOfDate is not allowed"):
        TcbPolicy(out_of_date_grace_seconds=10)
    with pytest.raises(ValueError, match="outside mask"):
        MaskedValue(value=3, mask=1)
    with pytest.raises(ValueError, match="Extra inputs"):
        TcbPolicy(allowed_status=["UpToDate"])  # type: ignore[call-arg]


def test_pinned_intel_root_is_the_root_dcap_qvl_trusts(
    real_quote: bytes, real_collateral: Collateral, pki: SimulatedPki
) -> None:
    import dcap_qvl

    from umbra.attest.intel_root import INTEL_SGX_ROOT_CA_DER, INTEL_SGX_ROOT_CA_SHA256

    assert hashlib.sha256(INTEL_SGX_ROOT_CA_DER).hexdigest() == INTEL_SGX_ROOT_CA_SHA256
    policy = dcap_qvl.QuotePolicy.claims_only(T_INSIDE)
    # Our pinned copy anchors the genuine quote exactly as dcap-qvl's built-in root does ...
    for root in (None, INTEL_SGX_ROOT_CA_DER):
        dcap_qvl.QuoteVerifier(root).verify_with_policy(
            real_quote, real_collateral.qvl, T_INSIDE, policy
        )
    # ... and another root does not.
    with pytest.raises(ValueError, match="Verification failed"):
        dcap_qvl.QuoteVerifier(pki.root_der).verify_with_policy(
            real_quote, real_collateral.qvl, T_INSIDE, policy
        )


def test_the_library_s_cause_is_kept(
    dstack_report: dict[str, object], real_collateral: Collateral
) -> None:
    """The dstack 0.6 quote's PCK certificate dates from 2025-09-16, after T_INSIDE: dcap-qvl's
    policy API says only "Failed to verify certificate chain"; the verdict says why (issue 24)."""
    raw = bytes.fromhex(str(dstack_report["quote"]))
    v = verify_quote(
        raw, policy=MeasurementPolicy(release=release_for(raw, other_runtime_events="allow")), collateral=real_collateral,
        now=T_INSIDE,
    )  # fmt: skip
    assert v.failed_steps == [Step.QUOTE_SIGNATURE]
    assert v.reasons == [
        "DCAP verification failed: Failed to verify certificate chain (cause: a certificate is "
        "not valid yet (time: 2025-07-19T10:00:34Z, not_before: 2025-09-16T02:28:15Z))"
    ]
