"""Builds the attested-release verifier from settings, on `umbra.attest` (fails closed: any
problem with the policy, collateral or root is a configuration error, not a weaker check)."""

from __future__ import annotations

from pathlib import Path

from umbra.attest.collateral import (
    Collateral,
    CollateralCache,
    CollateralSource,
    PccsCollateral,
    StaticCollateral,
)
from umbra.attest.errors import AttestError
from umbra.attest.measurement import load_measurement_policy
from umbra.attest.simpki import cert_der
from umbra.attest.verify import Verifier
from umbra.console.config import ConfigError, Settings
from umbra.console.enums import CvmKind
from umbra.console.release import AttestedReleaseVerifier


def verifier_from_settings(settings: Settings) -> AttestedReleaseVerifier | None:
    """The Security CVM image's release: secret release and Security CVM enrollment."""
    if settings.release_policy is None:
        return None
    return _verifier(settings, settings.release_policy, settings.release_binding)


def enrollment_verifiers(
    settings: Settings, security: AttestedReleaseVerifier | None
) -> dict[str, AttestedReleaseVerifier]:
    """One verifier per CVM kind, each against that kind's own release: a Dev CVM's quote is
    never checked against the Security CVM image's golden values, nor the other way round."""
    verifiers: dict[str, AttestedReleaseVerifier] = {}
    if security is not None:
        verifiers[CvmKind.security] = security
    if settings.dev_cvm_release_policy is not None:
        verifiers[CvmKind.dev] = _verifier(settings, settings.dev_cvm_release_policy, None)
    return verifiers


def _verifier(settings: Settings, release: Path, binding: Path | None) -> AttestedReleaseVerifier:
    try:
        policy = load_measurement_policy(release, binding)
        source = _collateral(settings)
        root = None
        if settings.release_simulated_root is not None:
            root = cert_der(settings.release_simulated_root.read_bytes())
    except (AttestError, OSError, ValueError) as exc:
        raise ConfigError(f"release: {exc}") from None
    return AttestedReleaseVerifier(Verifier(policy, source, settings.release_allow_simulated, root))


def _collateral(settings: Settings) -> CollateralSource:
    if settings.release_collateral is not None and settings.release_pccs:
        raise ConfigError("release: set release_collateral or release_pccs, not both")
    if settings.release_collateral is not None:
        return StaticCollateral(Collateral.from_file(settings.release_collateral))
    if settings.release_pccs:
        return PccsCollateral(
            settings.release_pccs, cache=CollateralCache(settings.release_collateral_cache)
        )
    raise ConfigError("release: collateral needed (release_collateral or release_pccs)")
