"""The full verification: quote → DCAP → TCB policy → TD checks → event log → named events.

Every check runs and every failure is reported; the verdict is OK only when there are none.

Why one module: the checks are one ordered pipeline over one quote and its evidence, each step's
input the previous step's output; split, the order and the one verdict that make it fail
closed would be spread over files. The parsers, collateral, the TCB policy
and the event log are their own modules.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from umbra.attest.azure import (
    AzureEvidence,
    HclReport,
    decode_envelope,
    is_azure_envelope,
    parse_hcl_report,
    tpm_nonce_for,
)
from umbra.attest.collateral import (
    Collateral,
    CollateralSource,
    RelayedCollateral,
    StaticCollateral,
)
from umbra.attest.collateral_check import check_collateral
from umbra.attest.dcap import CAUSE, verify_dcap
from umbra.attest.errors import (
    AttestError,
    CollateralRefusal,
    CollateralRefused,
    QuoteParseError,
)
from umbra.attest.eventlog import (
    RUNTIME_EVENT_TYPE,
    RUNTIME_IMR,
    Event,
    not_runtime,
    replay,
    runtime_event_digest,
)
from umbra.attest.intel_root import INTEL_SGX_ROOT_CA_DER
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.quote import Quote, parse_quote
from umbra.attest.tpm import verify_tpm_quote


class Step(StrEnum):
    """The verification step a failure belongs to: callers branch on it, people read the text."""

    EVIDENCE = "evidence"  # the quote / envelope / HCL report does not parse
    POLICY = "policy"  # the caller's settings refuse this kind of evidence (simulated, platform)
    COLLATERAL = "collateral"
    QUOTE_SIGNATURE = "quote_signature"  # PCK chain, QE report, quote signature (DCAP)
    FMSPC = "fmspc"  # the collateral's TCB info is for another platform than the PCK's FMSPC
    QE_IDENTITY = "qe_identity"  # the QE identity collateral is not one for this quote's QE
    DEBUG = "debug"  # a debug TD (TDATTRIBUTES.DEBUG): never accepted
    TCB = "tcb"
    MEASUREMENT = "measurement"  # MRTD, RTMR0-2, MRSEAM, PCRs, TD attributes, XFAM
    EVENT_LOG = "event_log"
    BINDING = "binding"  # report_data / user-data / vTPM nonce: freshness and channel binding
    PLATFORM = "platform"  # Azure: HCL report ↔ TD quote, vTPM quote signature and PCR digest


@dataclass(frozen=True)
class Failure:
    step: Step
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"step": self.step.value, "reason": self.reason}


@dataclass(frozen=True)
class Verdict:
    ok: bool
    simulated: bool
    reasons: list[str]
    tcb_status: str | None = None
    advisory_ids: list[str] = field(default_factory=list)
    quote: dict[str, Any] = field(default_factory=dict)
    events_checked: list[str] = field(default_factory=list)
    verified_at: int = 0
    failures: list[Failure] = field(default_factory=list)
    platform: str = "tdx"
    pcrs: dict[int, str] = field(default_factory=dict)
    # Set when the collateral itself was refused (missing, stale, tampered, revoked, ...).
    collateral_refusal: CollateralRefusal | None = None

    def with_failure(self, step: Step, reason: str) -> Verdict:
        """This verdict with one more failure (e.g. an event log that did not even parse)."""
        failures = [*self.failures, Failure(step, reason)]
        return replace(self, ok=False, failures=failures, reasons=[f.reason for f in failures])

    @property
    def failed_steps(self) -> list[Step]:
        return sorted({f.step for f in self.failures}, key=list(Step).index)

    def to_json(self) -> dict[str, Any]:
        extra = (
            {}
            if self.collateral_refusal is None
            else {"collateral_refusal": self.collateral_refusal.value}
        )
        return {
            **extra,
            "ok": self.ok,
            "verdict": "PASS" if self.ok else "FAIL",
            "simulated": self.simulated,
            "platform": self.platform,
            "reasons": self.reasons,
            "failures": [f.to_json() for f in self.failures],
            "failed_steps": [s.value for s in self.failed_steps],
            "pcrs": {str(i): v for i, v in sorted(self.pcrs.items())},
            "tcb_status": self.tcb_status,
            "advisory_ids": self.advisory_ids,
            "quote": self.quote,
            "events_checked": self.events_checked,
            "verified_at": self.verified_at,
        }


def summarize(q: Quote) -> dict[str, Any]:
    td = q.td_report
    return {
        "version": q.header.version,
        "td_report": td.version.value,
        "mr_td": td.mr_td.hex(),
        "rtmr0": td.rtmrs[0].hex(),
        "rtmr1": td.rtmrs[1].hex(),
        "rtmr2": td.rtmrs[2].hex(),
        "rtmr3": td.rtmrs[3].hex(),
        "mr_seam": td.mr_seam.hex(),
        "td_attributes": f"{td.td_attributes_int:016x}",
        "xfam": f"{td.xfam_int:016x}",
        "report_data": td.report_data.hex(),
        "debug": td.debug,
    }


@dataclass
class Verifier:
    """Verification settings that do not change per quote.

    Simulated quotes are verified by the same code with a different root CA, and only when
    *both* the caller sets `allow_simulated` (and supplies the simulated root) *and* the
    measurement policy says `tee: simulated`.

    With a `RelayedCollateral` source, the collateral is what the peer sent with its evidence
    (`verify(..., relayed_collateral=...)`); any other source ignores relayed bytes. Either way
    the set's signatures and CRLs are checked up to the pinned root, then DCAP runs.
    """

    policy: MeasurementPolicy
    collateral: CollateralSource
    allow_simulated: bool = False
    simulated_root_der: bytes | None = None

    def verify(
        self,
        raw_quote: bytes,
        *,
        event_log: Sequence[Event] | None = None,
        expected_report_data: bytes | None = None,
        now: int | None = None,
        relayed_collateral: bytes | None = None,
    ) -> Verdict:
        """Verify a bare TDX quote or an Azure evidence envelope (`umbra.attest.azure`): the
        bytes say which, the policy's `platform` says which is acceptable."""
        when = int(time.time()) if now is None else now
        try:
            return self._verify(
                raw_quote, event_log, expected_report_data, when, relayed_collateral
            )
        except AttestError as exc:  # an error from a deeper layer is a failed verdict, not a crash
            reason = str(exc)
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            # A parser that missed a case must still fail closed, never crash the caller.
            reason = f"evidence could not be processed ({type(exc).__name__}: {exc})"
        return Verdict(
            ok=False,
            simulated=False,
            reasons=[reason],
            verified_at=when,
            failures=[Failure(Step.EVIDENCE, reason)],
        )

    def _verify(
        self,
        raw_evidence: bytes,
        event_log: Sequence[Event] | None,
        expected_report_data: bytes | None,
        now: int,
        relayed: bytes | None = None,
    ) -> Verdict:
        simulated = self.policy.tee == "simulated"
        platform = self.policy.release.platform
        failures: list[Failure] = []

        def add(step: Step, *reasons: str) -> None:
            failures.extend(Failure(step, r) for r in reasons)

        def done(**kw: Any) -> Verdict:
            return Verdict(
                ok=not failures,
                simulated=simulated,
                reasons=[f.reason for f in failures],
                verified_at=now,
                failures=list(failures),
                platform=platform,
                **kw,
            )

        azure: AzureEvidence | None = None
        hcl: HclReport | None = None
        raw_quote = raw_evidence
        if is_azure_envelope(raw_evidence):
            if platform != "azure-tdx":
                add(Step.POLICY, "Azure evidence, but the release's platform is tdx")
                return done()
            try:
                azure = decode_envelope(raw_evidence)
                hcl = parse_hcl_report(azure.hcl_report)
            except QuoteParseError as exc:
                add(Step.EVIDENCE, f"malformed Azure evidence: {exc}")
                return done()
            raw_quote = azure.td_quote
        elif platform == "azure-tdx":
            add(Step.POLICY, "a bare TDX quote, but the release's platform is azure-tdx")
            return done()

        try:
            q = parse_quote(raw_quote)
        except QuoteParseError as exc:
            add(Step.EVIDENCE, f"malformed quote: {exc}")
            return done()
        summary = summarize(q)

        root: bytes | None = None
        if simulated:
            if not self.allow_simulated:
                add(
                    Step.POLICY,
                    "the measurement policy says tee: simulated, but simulated quotes were "
                    "not allowed by the caller (allow_simulated)",
                )
                return done(quote=summary)
            if self.simulated_root_der is None:
                add(Step.POLICY, "simulated quotes allowed but no simulated root CA given")
                return done(quote=summary)
            root = self.simulated_root_der

        anchor = root if root is not None else INTEL_SGX_ROOT_CA_DER
        if not hmac.compare_digest(q.pck_root_der, anchor):
            add(
                Step.QUOTE_SIGNATURE,
                "the quote's PCK chain does not end in the "
                + ("simulated root CA" if simulated else "Intel SGX Root CA"),
            )

        try:
            if isinstance(self.collateral, RelayedCollateral):
                collateral = self.collateral.accept(raw_quote, relayed, now)
            else:
                collateral = self.collateral.collateral_for(raw_quote, now)
        except CollateralRefused as exc:
            add(Step.COLLATERAL, str(exc))
            return done(quote=summary, collateral_refusal=exc.refusal)
        except AttestError as exc:
            add(Step.COLLATERAL, f"collateral unavailable: {exc}")
            return done(quote=summary)

        if now >= collateral.expires_at:
            # Said plainly rather than as dcap-qvl's CRL/TCB-info error text.
            add(Step.COLLATERAL, f"collateral expired at {_iso(collateral.expires_at)}")
            return done(quote=summary, collateral_refusal=CollateralRefusal.STALE)
        try:
            check_collateral(collateral, q.pck_chain_pem, anchor)
        except CollateralRefused as exc:
            add(Step.COLLATERAL, str(exc))
            return done(quote=summary, collateral_refusal=exc.refusal)
        dcap = verify_dcap(raw_quote, collateral, now, self.policy.release.tcb, root_ca_der=root)
        for reason in dcap.reasons:
            add(_dcap_step(reason, dcap.status), reason)
        if q.td_report.debug:
            add(Step.DEBUG, DEBUG_TD)
        add(Step.MEASUREMENT, *td_reasons(q, self.policy))
        pcrs: dict[int, str] = {}
        if azure is not None and hcl is not None:
            pcrs = _azure_checks(q, hcl, azure, self.policy, expected_report_data, add)
        elif expected_report_data is not None and not hmac.compare_digest(
            q.td_report.report_data, expected_report_data
        ):
            add(Step.BINDING, "report_data does not match the expected value (stale or replayed?)")
        log_reasons: list[str] = []
        if azure is not None:
            checked: list[str] = []
            if event_log is not None:
                log_reasons.append("event logs are not replayed on azure-tdx (RTMRs stay zero)")
        else:
            checked = event_reasons(q, self.policy, event_log, log_reasons)
        add(Step.EVENT_LOG, *log_reasons)
        return done(
            tcb_status=dcap.status,
            advisory_ids=dcap.advisory_ids,
            quote=summary,
            events_checked=checked,
            pcrs=pcrs,
        )


# dcap-qvl's texts for failures that are neither a signature nor stale collateral.
_DCAP_STEPS = (
    ("Fmspc mismatch", Step.FMSPC),
    ("Unsupported QE Identity", Step.QE_IDENTITY),
    ("Debug mode", Step.DEBUG),
)


def _dcap_step(reason: str, status: str | None) -> Step:
    """Which step a DCAP reason belongs to. With a TCB status, the chain verified and our TCB
    policy refused; without one, dcap-qvl stopped early, and its text says where (not the
    cause appended to it: an expired PCK certificate is still the quote's chain)."""
    reason = reason.partition(CAUSE)[0]
    if status is not None or "TCB level" in reason:
        return Step.TCB
    for needle, step in _DCAP_STEPS:
        if needle in reason:
            return step
    if any(w in reason for w in ("Crl", "CRL", "expired", "issue date", "TCBInfo", "QEIdentity")):
        return Step.COLLATERAL
    return Step.QUOTE_SIGNATURE


def _iso(ts: int) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _azure_checks(
    q: Quote,
    hcl: HclReport,
    ev: AzureEvidence,
    policy: MeasurementPolicy,
    expected_report_data: bytes | None,
    add: Callable[..., None],
) -> dict[int, str]:
    """The paravisor chain after DCAP: HCL TD report = quoted TD report, runtime data bound by
    REPORTDATA, user-data = the expected binding, vTPM quote by the bound AK, PCRs by policy.
    Returns the PCR values, hex, once the vTPM quote vouches for them (else empty)."""
    td, hc = q.td_report, hcl.td_report
    pairs = (
        ("REPORTDATA", td.report_data, hc.report_data),
        ("TEE_TCB_SVN", td.tee_tcb_svn, hc.tee_tcb_svn),
        ("MRSEAM", td.mr_seam, hc.mr_seam),
        ("MRSIGNERSEAM", td.mr_signer_seam, hc.mr_signer_seam),
        ("SEAMATTRIBUTES", td.seam_attributes, hc.seam_attributes),
        ("TDATTRIBUTES", td.td_attributes, hc.td_attributes),
        ("XFAM", td.xfam, hc.xfam),
        ("MRTD", td.mr_td, hc.mr_td),
        ("MRCONFIGID", td.mr_config_id, hc.mr_config_id),
        ("MROWNER", td.mr_owner, hc.mr_owner),
        ("MROWNERCONFIG", td.mr_owner_config, hc.mr_owner_config),
        *((f"RTMR{i}", td.rtmrs[i], hc.rtmrs[i]) for i in range(4)),
    )
    differ = [name for name, a, b in pairs if not hmac.compare_digest(a, b)]
    if differ:
        add(
            Step.PLATFORM,
            "the HCL report's TD report differs from the quoted one: " + ", ".join(differ),
        )
    runtime = hcl.runtime_data
    if not hmac.compare_digest(td.report_data, hashlib.sha256(runtime.raw).digest() + bytes(32)):
        add(
            Step.BINDING,
            "REPORTDATA is not SHA-256 of the runtime data: the runtime data is not bound",
        )
        return {}
    if expected_report_data is not None and (
        runtime.user_data is None
        or not hmac.compare_digest(runtime.user_data, expected_report_data)
    ):
        add(
            Step.BINDING,
            "the runtime data's user-data does not match the expected value (stale or replayed?)",
        )
    nonce = tpm_nonce_for(expected_report_data) if expected_report_data is not None else None
    _, tpm_reasons = verify_tpm_quote(ev.tpm_attest, ev.tpm_signature, ev.pcrs, runtime.ak, nonce)
    for reason in tpm_reasons:
        add(Step.BINDING if "nonce" in reason else Step.PLATFORM, reason)
    if tpm_reasons:
        return {}
    values = {i: v.hex() for i, v in ev.pcrs.items()}
    for index, accepted in sorted((policy.release.pcrs or {}).items()):
        if values.get(index) not in accepted:
            add(
                Step.MEASUREMENT,
                f"PCR{index} {values.get(index)} is not among the release's accepted values",
            )
    if any(any(r) for r in td.rtmrs):
        add(Step.MEASUREMENT, "RTMRs are not zero, which the Azure paravisor never leaves them")
    return values


DEBUG_TD = "the TD is a debug TD (TDATTRIBUTES.DEBUG set): never accepted"


def td_reasons(q: Quote, policy: MeasurementPolicy) -> list[str]:
    td = q.td_report
    rel = policy.release
    out: list[str] = []  # DEBUG is refused on its own step (DEBUG_TD), whatever the policy
    if not rel.td.attributes.matches(td.td_attributes_int):
        out.append(
            f"TD attributes {td.td_attributes_int:016x} & mask {rel.td.attributes.mask:016x} "
            f"!= {rel.td.attributes.value:016x}"
        )
    if not rel.td.xfam.matches(td.xfam_int):
        out.append(
            f"XFAM {td.xfam_int:016x} & mask {rel.td.xfam.mask:016x} != {rel.td.xfam.value:016x}"
        )
    pairs: list[tuple[str, bytes, list[str] | None]] = [
        ("MRTD", td.mr_td, rel.mrtd),
        ("RTMR0", td.rtmrs[0], rel.rtmr0),
        ("RTMR1", td.rtmrs[1], rel.rtmr1),
        ("RTMR2", td.rtmrs[2], rel.rtmr2),
        ("MRSEAM", td.mr_seam, rel.mr_seam),
    ]
    for label, actual, accepted in pairs:
        if accepted is not None and actual.hex() not in accepted:
            out.append(f"{label} {actual.hex()} is not among the release's accepted values")
    return out


def event_reasons(
    q: Quote, policy: MeasurementPolicy, log: Sequence[Event] | None, reasons: list[str]
) -> list[str]:
    """Replay the log against the quoted RTMRs, then check expected events; return names checked."""
    expected = policy.expected_events()
    if log is None:
        if expected:
            reasons.append(
                "no event log supplied, but the policy expects events: "
                + ", ".join(e.name for e in expected)
            )
        elif policy.release.other_runtime_events == "refuse" and any(q.td_report.rtmrs[3]):
            # Something was extended into RTMR3 and nobody showed us what: fail closed.
            reasons.append("RTMR3 holds runtime events but no event log accounts for them")
        return []
    # The parsers already refuse these; Events built in code get the same rule here: a
    # non-runtime event on RTMR3 would replay yet escape every named-event check.
    forged = [
        not_runtime(e.event_type)
        for e in log
        if e.imr == RUNTIME_IMR and e.event_type != RUNTIME_EVENT_TYPE
    ]
    forged += [
        f"runtime event {e.name!r} (RTMR{e.imr}): digest does not match its name and payload"
        for e in log
        if e.event_type == RUNTIME_EVENT_TYPE
        and e.digest != runtime_event_digest(e.name, e.payload)
    ]
    if forged:
        reasons.extend(forged)
        return []
    replayed = replay(log)
    mismatched = [i for i in range(4) if replayed[i] != q.td_report.rtmrs[i]]
    for i in mismatched:
        reasons.append(
            f"event log replays RTMR{i} to {replayed[i].hex()}, quote has "
            f"{q.td_report.rtmrs[i].hex()}"
        )
    if mismatched:
        return []  # an event log that does not replay says nothing about any event
    runtime = [e for e in log if e.event_type == RUNTIME_EVENT_TYPE]
    wanted = {(e.name, e.imr) for e in expected}
    checked: list[str] = []
    for exp in expected:
        hits = [e for e in runtime if e.name == exp.name and e.imr == exp.imr]
        if not hits:
            reasons.append(f"expected event {exp.name!r} is missing from RTMR{exp.imr}")
        elif len(hits) > 1:
            reasons.append(f"event {exp.name!r} appears {len(hits)} times in RTMR{exp.imr}")
        elif exp.payloads is not None and hits[0].payload.hex() not in exp.payloads:
            reasons.append(
                f"event {exp.name!r} has payload {hits[0].payload.hex()[:96]}, "
                "not an accepted value"
            )
        else:
            checked.append(exp.name)
    if policy.release.other_runtime_events == "refuse":
        others = sorted({e.name for e in runtime if (e.name, e.imr) not in wanted})
        if others:
            reasons.append("runtime events not in the policy: " + ", ".join(others))
    return checked


def verify_quote(
    raw_quote: bytes,
    *,
    policy: MeasurementPolicy,
    collateral: Collateral | CollateralSource,
    now: int | None = None,
    event_log: Sequence[Event] | None = None,
    expected_report_data: bytes | None = None,
    allow_simulated: bool = False,
    simulated_root_der: bytes | None = None,
) -> Verdict:
    """One-shot form of `Verifier(...).verify(...)`."""
    source = StaticCollateral(collateral) if isinstance(collateral, Collateral) else collateral
    return Verifier(policy, source, allow_simulated, simulated_root_der).verify(
        raw_quote, event_log=event_log, expected_report_data=expected_report_data, now=now
    )
