"""Egress policy: profile files, their composition, the matcher and signed bundles.

This is the one policy model; the CLI, the Console and the proxy all use it.
"""

from umbra.policy.bundle import BundleError, VerifiedBundle, verify_bundle
from umbra.policy.compiled import CompiledInject, CompiledProfile, CompiledScan
from umbra.policy.compose import CompositionError, EffectivePolicy, deny_all
from umbra.policy.errors import PolicyError, PolicyIssue
from umbra.policy.matcher import Decision, Reason, Verdict, decide_push
from umbra.policy.normalize import (
    NormalizationError,
    RequestPath,
    normalize_host,
    normalize_path,
    normalize_request_path,
)

__all__ = [
    "BundleError",
    "CompiledInject",
    "CompiledProfile",
    "CompiledScan",
    "CompositionError",
    "Decision",
    "EffectivePolicy",
    "NormalizationError",
    "PolicyError",
    "PolicyIssue",
    "Reason",
    "RequestPath",
    "Verdict",
    "VerifiedBundle",
    "decide_push",
    "deny_all",
    "normalize_host",
    "normalize_path",
    "normalize_request_path",
    "verify_bundle",
]
