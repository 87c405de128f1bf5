"""DCAP verification through dcap-qvl, then our TCB policy on its claims.

Two gates must both accept: dcap-qvl's own policy, configured from ours (strict + allowed
statuses + grace + PCK flags), and our rules evaluated on the claims that run returns, so that a
misreading of the claims on either side fails closed. On the accepting path dcap-qvl runs once:
a policy-gated run returns the same claims as a `claims_only` one. Only when dcap-qvl's gate
refuses does it run again with `claims_only`, to tell a broken chain or signature from a policy
refusal and to list *every* policy reason.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
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
    gate_refusal: str | None = None
    try:
        claims_obj = verifier.verify_with_policy(
            raw_quote, collateral.qvl, now, _qvl_policy(policy, now)
        )
    except BaseException as exc:  # a Rust panic surfaces as BaseException: still "not verified"
        _reraise_control(exc)
        gate_refusal = _clean(exc)
        try:
            claims_obj = verifier.verify_with_policy(
                raw_quote, collateral.qvl, now, dcap_qvl.QuotePolicy.claims_only(now)
            )
        except BaseException as exc:
            _reraise_control(exc)
            cause = _with_cause(_clean(exc), raw_quote, collateral, now, root_ca_der)
            return DcapResult(reasons=[f"DCAP verification failed: {cause}"])
    claims: dict[str, Any] = json.loads(claims_obj.to_json())
    tcb = claims.get("tcb", {})
    status = str(tcb.get("status", ""))
    advisories = [str(a) for a in tcb.get("advisory_ids", [])]
    reasons = _policy_reasons(claims, status, advisories, collateral, now, policy)
    if not reasons and gate_refusal is not None:
        reasons.append(f"dcap-qvl policy rejected the quote: {gate_refusal}")
    return DcapResult(reasons=reasons, status=status, advisory_ids=advisories, claims=claims)


def _with_cause(
    text: str, raw_quote: bytes, collateral: Collateral, now: int, root_ca_der: bytes | None
) -> str:
    """`verify_with_policy` drops the library's cause ("Failed to verify certificate chain",
    not why); the one-shot `verify` keeps it. Asked only on this failure path."""
    try:
        if root_ca_der is None:
            dcap_qvl.verify(raw_quote, collateral.qvl, now)
        else:
            dcap_qvl.verify_with_root_ca(raw_quote, collateral.qvl, root_ca_der, now)
    except BaseException as exc:
        _reraise_control(exc)
        head, sep, cause = _clean(exc).partition("Caused by:")
        if sep and head.strip() == text:
            lines = [_CAUSE_INDEX.sub("", ln.strip()) for ln in cause.strip().splitlines()]
            return f"{text}{CAUSE}{_plain('; '.join(ln for ln in lines if ln))})"
    return text


CAUSE = " (cause: "  # what the library says went wrong; the step follows the text before it
_CAUSE_INDEX = re.compile(r"^\d+: ")
_UNIX_TIME = re.compile(r"UnixTime\((\d+)\)")
_PLAIN = {
    "CertNotValidYet": "a certificate is not valid yet",
    "CertExpired": "a certificate has expired",
}


def _plain(cause: str) -> str:
    """webpki's Debug text in plain words: `CertNotValidYet { time: UnixTime(1752919234),
    not_before: UnixTime(1757989695) }` -> `a certificate is not valid yet (time:
    2025-07-19T09:20:34Z, not_before: 2025-09-16T02:28:15Z)`."""
    cause = _UNIX_TIME.sub(lambda m: _iso(int(m.group(1))), cause)
    for name, words in _PLAIN.items():
        cause = re.sub(rf"\b{name} \{{ (.*?) \}}", rf"{words} (\1)", cause)
    return cause


def _iso(ts: int) -> str:
    try:
        return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, ValueError, OSError):
        return str(ts)


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
