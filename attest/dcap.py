"""DCAP verification through dcap-qvl, then our TCB policy on its claims.

dcap-qvl runs twice: first with its `claims_only` policy, which does every cryptographic and
validity-window check and hands back the claims, so that we can list *every* policy reason;
then, when our own checks pass, with a dcap-qvl policy configured from ours, as a second gate
that fails closed should our reading of the claims ever diverge from dcap-qvl's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import dcap_qvl

from umbra.attest.collateral import Collateral
from umbra.attest.tcb import OUT_OF_DATE_STATUSES, TcbPolicy, TcbStatus


@dataclass(frozen=True)
class DcapResult:
    reasons: list[str]
    status: str | None = None
    advisory_ids: list[str] = field(default_factory=list)
    claims: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.reasons


def _qvl_policy(policy: TcbPolicy, now: int) -> Any:
    p = dcap_qvl.QuotePolicy.strict(now)
    for status in policy.allowed_statuses:
        if status is not TcbStatus.UP_TO_DATE:
            p = p.allow_status(status.value)
    if policy.out_of_date_grace_seconds:
        p = p.platform_grace_period(policy.out_of_date_grace_seconds)
    if policy.min_tcb_eval_data_number is not None:
        p = p.min_tcb_eval_data_number(policy.min_tcb_eval_data_number)
    return (
        p.allow_dynamic_platform(policy.allow_dynamic_platform)
        .allow_cached_keys(policy.allow_cached_keys)
        .allow_smt(policy.allow_smt)
    )


def verify_dcap(
    raw_quote: bytes,
    collateral: Collateral,
    now: int,
    policy: TcbPolicy,
    *,
    root_ca_der: bytes | None = None,
) -> DcapResult:
    """Verify signatures, chain, CRLs, TCB level and QE identity; then apply `policy`.

    `root_ca_der` None means Intel's SGX root CA built into dcap-qvl.
    """
    verifier = dcap_qvl.QuoteVerifier(root_ca_der)
    try:
        claims_obj = verifier.verify_with_policy(
            raw_quote, collateral.qvl, now, dcap_qvl.QuotePolicy.claims_only(now)
        )
    except BaseException as exc:  # a Rust panic surfaces as BaseException: still "not verified"
        _reraise_control(exc)
        return DcapResult(reasons=[f"DCAP verification failed: {_clean(exc)}"])
    claims: dict[str, Any] = json.loads(claims_obj.to_json())
    tcb = claims.get("tcb", {})
    status = str(tcb.get("status", ""))
    advisories = [str(a) for a in tcb.get("advisory_ids", [])]
    reasons = _policy_reasons(claims, status, advisories, collateral, now, policy)
    if not reasons:
        try:
            verifier.verify_with_policy(raw_quote, collateral.qvl, now, _qvl_policy(policy, now))
        except BaseException as exc:
            _reraise_control(exc)
            reasons.append(f"dcap-qvl policy rejected the quote: {_clean(exc)}")
    return DcapResult(reasons=reasons, status=status, advisory_ids=advisories, claims=claims)


def _policy_reasons(
    claims: dict[str, Any],
    status: str,
    advisories: list[str],
    collateral: Collateral,
    now: int,
    policy: TcbPolicy,
) -> list[str]:
    reasons: list[str] = []
    allowed = {s.value for s in policy.allowed_statuses}
    if status not in allowed:
        reasons.append(
            f"TCB status {status} is not allowed (allowed: {', '.join(sorted(allowed))})"
        )
    elif status in OUT_OF_DATE_STATUSES:
        tag = int(claims.get("platform", {}).get("tcb_date_tag", 0))
        if tag + policy.out_of_date_grace_seconds < now:
            reasons.append(
                f"TCB status {status}: TCB level date {tag} + grace "
                f"{policy.out_of_date_grace_seconds}s is before now {now}"
            )
    allowed_adv = {a.upper() for a in policy.allowed_advisories}
    bad = [a for a in advisories if a.upper() not in allowed_adv]
    if bad:
        reasons.append(f"advisories not in the allowlist: {', '.join(bad)}")
    age = now - collateral.issue_date
    if age > policy.max_collateral_age_seconds:
        reasons.append(
            f"collateral is {age}s old, older than the {policy.max_collateral_age_seconds}s allowed"
        )
    if age < 0:
        reasons.append("collateral was issued after the verification time")
    pck = claims.get("platform", {}).get("pck", {})
    for flag, allow, label in (
        ("dynamic_platform", policy.allow_dynamic_platform, "dynamic platform"),
        ("cached_keys", policy.allow_cached_keys, "cached keys"),
        ("smt_enabled", policy.allow_smt, "SMT"),
    ):
        if not allow and str(pck.get(flag)) == "True":
            reasons.append(f"PCK certificate reports {label}, which the policy refuses")
    if policy.min_tcb_eval_data_number is not None:
        n = int(tcb_eval(claims))
        if n < policy.min_tcb_eval_data_number:
            reasons.append(
                f"TCB evaluation data number {n} < minimum {policy.min_tcb_eval_data_number}"
            )
    return reasons


def tcb_eval(claims: dict[str, Any]) -> int:
    return int(claims.get("tcb", {}).get("eval_data_number", 0))


def _reraise_control(exc: BaseException) -> None:
    if isinstance(exc, KeyboardInterrupt | SystemExit | GeneratorExit):
        raise exc


def _clean(exc: BaseException) -> str:
    return str(exc).removeprefix("Verification failed: ").strip() or type(exc).__name__
