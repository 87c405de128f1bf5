"""umbra.attest: TDX quote parsing (bare, or through Azure's paravisor and vTPM) and DCAP verification, event-log replay, measurement
policy, attested TLS, and a simulated TEE. Depends on nothing else in Umbra.

The entry points other parts call are re-exported here; see docs/specs/attestation.md.

Importing this package loads nothing: the names below resolve on first use (PEP 562), so a caller
that needs one submodule (or `umbra --help`) does not pay for pyOpenSSL, dcap-qvl and cryptography.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from umbra.attest.atls import ATLSConnection, atls_connect, serve_atls
    from umbra.attest.azure_source import AzureVtpmSource
    from umbra.attest.collateral import (
        Collateral,
        CollateralCache,
        CollateralSource,
        PccsCollateral,
        StaticCollateral,
    )
    from umbra.attest.errors import (
        ATLSError,
        AttestError,
        CollateralError,
        EventLogError,
        EvidenceFormatError,
        PolicyFileError,
        QuoteParseError,
        QuoteSourceError,
    )
    from umbra.attest.eventlog import Event, load_event_log, make_runtime_event, replay
    from umbra.attest.measurement import (
        InstanceBinding,
        MeasurementPolicy,
        ReleaseManifest,
        load_measurement_policy,
        ssh_keys_digest,
    )
    from umbra.attest.quote import Quote, parse_quote
    from umbra.attest.quote_source import ConfigfsTsmSource, QuoteSource, SimulatedSource
    from umbra.attest.simazure import SimulatedAzureCvm
    from umbra.attest.simpccs import SimulatedPccs
    from umbra.attest.simpki import SimulatedPki
    from umbra.attest.simulator import SimulatedTdx
    from umbra.attest.verify import Failure, Step, Verdict, Verifier, verify_quote

_WHERE = {
    "ATLSConnection": "umbra.attest.atls",
    "ATLSError": "umbra.attest.errors",
    "AttestError": "umbra.attest.errors",
    "AzureVtpmSource": "umbra.attest.azure_source",
    "Collateral": "umbra.attest.collateral",
    "CollateralCache": "umbra.attest.collateral",
    "CollateralError": "umbra.attest.errors",
    "CollateralSource": "umbra.attest.collateral",
    "ConfigfsTsmSource": "umbra.attest.quote_source",
    "Event": "umbra.attest.eventlog",
    "EventLogError": "umbra.attest.errors",
    "EvidenceFormatError": "umbra.attest.errors",
    "Failure": "umbra.attest.verify",
    "InstanceBinding": "umbra.attest.measurement",
    "MeasurementPolicy": "umbra.attest.measurement",
    "PccsCollateral": "umbra.attest.collateral",
    "PolicyFileError": "umbra.attest.errors",
    "Quote": "umbra.attest.quote",
    "QuoteParseError": "umbra.attest.errors",
    "QuoteSource": "umbra.attest.quote_source",
    "QuoteSourceError": "umbra.attest.errors",
    "ReleaseManifest": "umbra.attest.measurement",
    "SimulatedAzureCvm": "umbra.attest.simazure",
    "SimulatedPccs": "umbra.attest.simpccs",
    "SimulatedPki": "umbra.attest.simpki",
    "SimulatedSource": "umbra.attest.quote_source",
    "SimulatedTdx": "umbra.attest.simulator",
    "StaticCollateral": "umbra.attest.collateral",
    "Step": "umbra.attest.verify",
    "Verdict": "umbra.attest.verify",
    "Verifier": "umbra.attest.verify",
    "atls_connect": "umbra.attest.atls",
    "load_event_log": "umbra.attest.eventlog",
    "load_measurement_policy": "umbra.attest.measurement",
    "make_runtime_event": "umbra.attest.eventlog",
    "parse_quote": "umbra.attest.quote",
    "replay": "umbra.attest.eventlog",
    "serve_atls": "umbra.attest.atls",
    "ssh_keys_digest": "umbra.attest.measurement",
    "verify_quote": "umbra.attest.verify",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        # `umbra.attest.verify` etc. as attributes, as when this file imported them all.
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule exists; something it imports does not
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ATLSConnection",
    "ATLSError",
    "AttestError",
    "AzureVtpmSource",
    "Collateral",
    "CollateralCache",
    "CollateralError",
    "CollateralSource",
    "ConfigfsTsmSource",
    "Event",
    "EventLogError",
    "EvidenceFormatError",
    "Failure",
    "InstanceBinding",
    "MeasurementPolicy",
    "PccsCollateral",
    "PolicyFileError",
    "Quote",
    "QuoteParseError",
    "QuoteSource",
    "QuoteSourceError",
    "ReleaseManifest",
    "SimulatedAzureCvm",
    "SimulatedPccs",
    "SimulatedPki",
    "SimulatedSource",
    "SimulatedTdx",
    "StaticCollateral",
    "Step",
    "Verdict",
    "Verifier",
    "atls_connect",
    "load_event_log",
    "load_measurement_policy",
    "make_runtime_event",
    "parse_quote",
    "replay",
    "serve_atls",
    "ssh_keys_digest",
    "verify_quote",
]
