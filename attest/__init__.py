"""umbra.attest: TDX quote parsing (bare, or through Azure's paravisor and vTPM) and DCAP verification, event-log replay, measurement
policy, attested TLS, and a simulated TEE. Depends on nothing else in Umbra.

The entry points other parts call are re-exported here; see docs/specs/attestation.md.
"""

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
