"""The full verification: quote → DCAP → TCB policy → TD checks → event log → named events.

Every check runs and every failure is reported; the verdict is OK only when there are none.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.serialization import Encoding

from umbra.attest.collateral import Collateral, CollateralSource, StaticCollateral
from umbra.attest.dcap import verify_dcap
from umbra.attest.errors import AttestError, QuoteParseError
from umbra.attest.eventlog import RUNTIME_EVENT_TYPE, Event, replay
from umbra.attest.intel_root import INTEL_SGX_ROOT_CA_DER
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.quote import Quote, parse_quote


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

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "verdict": "PASS" if self.ok else "FAIL",
            "simulated": self.simulated,
            "reasons": self.reasons,
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
    ) -> Verdict:
        when = int(time.time()) if now is None else now
        try:
            return self._verify(raw_quote, event_log, expected_report_data, when)
        except AttestError as exc:  # an error from a deeper layer is a failed verdict, not a crash
            return Verdict(ok=False, simulated=False, reasons=[str(exc)], verified_at=when)

    def _verify(
        self,
        raw_quote: bytes,
        event_log: Sequence[Event] | None,
        expected_report_data: bytes | None,
        now: int,
    ) -> Verdict:
        simulated = self.policy.tee == "simulated"
        reasons: list[str] = []

        def fail(*more: str, **kw: Any) -> Verdict:
            return Verdict(
                ok=False, simulated=simulated, reasons=reasons + list(more), verified_at=now, **kw
            )

        try:
            q = parse_quote(raw_quote)
        except QuoteParseError as exc:
            return fail(f"malformed quote: {exc}")
        summary = summarize(q)

        root: bytes | None = None
        if simulated:
            if not self.allow_simulated:
                return fail(
                    "the measurement policy says tee: simulated, but simulated quotes were "
                    "not allowed by the caller (allow_simulated)",
                    quote=summary,
                )
            if self.simulated_root_der is None:
                return fail(
                    "simulated quotes allowed but no simulated root CA given", quote=summary
                )
            root = self.simulated_root_der

        anchor = root if root is not None else INTEL_SGX_ROOT_CA_DER
        try:
            chain_root = q.pck_chain[-1].public_bytes(Encoding.DER)
        except (ValueError, TypeError):
            chain_root = b""
        if not hmac.compare_digest(chain_root, anchor):
            reasons.append(
                "the quote's PCK chain does not end in the "
                + ("simulated root CA" if simulated else "Intel SGX Root CA")
            )

        try:
            collateral = self.collateral.collateral_for(raw_quote, now)
        except AttestError as exc:
            return fail(f"collateral unavailable: {exc}", quote=summary)

        tcb = self.policy.release.tcb
        dcap = verify_dcap(raw_quote, collateral, now, tcb, root_ca_der=root)
        reasons.extend(dcap.reasons)
        reasons.extend(td_reasons(q, self.policy))
        if expected_report_data is not None and not hmac.compare_digest(
            q.td_report.report_data, expected_report_data
        ):
            reasons.append("report_data does not match the expected value (stale or replayed?)")
        checked = event_reasons(q, self.policy, event_log, reasons)
        return Verdict(
            ok=not reasons,
            simulated=simulated,
            reasons=reasons,
            tcb_status=dcap.status,
            advisory_ids=dcap.advisory_ids,
            quote=summary,
            events_checked=checked,
            verified_at=now,
        )


def td_reasons(q: Quote, policy: MeasurementPolicy) -> list[str]:
    td = q.td_report
    rel = policy.release
    out: list[str] = []
    if td.debug:
        out.append("the TD is a debug TD (TDATTRIBUTES.DEBUG set): never accepted")
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
    wanted = {e.name for e in expected}
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
        others = sorted({e.name for e in runtime if e.name not in wanted})
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
