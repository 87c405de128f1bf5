"""The tunnel endpoint's attestation evidence: a quote source and the event log served with it.

`configfs`: the TD's configfs-tsm quotes (production); the event log file, if given, is served as
is: forwarders replay it against the quote's RTMRs, so it needs no trust of its own.
`azure`: an Azure TDX CVM under its paravisor: the vTPM's HCL report and the IMDS TD quote, sent
as one Azure evidence envelope (`umbra.attest.azure`); the binding lives in the vTPM, so there is no
RTMR3 event log to serve.
`simulated`: a simulated TD signed by the PKI in `pki_dir` whose RTMR3 is extended with the
runtime events of the event log file (embedded default and tests only; verifiers accept it only
when told to).
`emulated`: an emulated-cloud VM's quotes from the host's simulated TDX module, through the launch
agent's quote relay socket (`umbra.attest.tdx_port`); the event log file is served as is, as
for `configfs` (the agent measured into the module). Simulated root: accepted only when told to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from umbra.attest.azure_source import AzureVtpmSource
from umbra.attest.errors import AttestError
from umbra.attest.eventlog import Event, load_event_log
from umbra.attest.quote_source import ConfigfsTsmSource, QuoteSource, SimulatedSource
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.tdx_port import TdxQuoteSocketSource

QuoteSourceKind = Literal["configfs", "azure", "simulated", "emulated"]
Evidence = tuple[QuoteSource, Callable[[], Sequence[Event]] | None]


class EvidenceError(Exception):
    pass


def build_evidence(
    kind: QuoteSourceKind,
    *,
    event_log: Path | None = None,
    simulated_pki: Path | None = None,
    simulated_image: str = "umbra-security-cvm",
    tdx_quote_socket: Path | None = None,
) -> Evidence:
    events: list[Event] | None = None
    if event_log is not None:
        try:
            events = load_event_log(event_log.read_bytes())
        except OSError as exc:
            raise EvidenceError(f"{event_log}: {exc.strerror}") from None
        except AttestError as exc:
            raise EvidenceError(f"{event_log}: not a valid event log: {exc}") from None
    if (kind == "emulated") != (tdx_quote_socket is not None):
        raise EvidenceError("--quote-source emulated goes with --tdx-quote-socket, and only it")
    if tdx_quote_socket is not None:
        if simulated_pki is not None:
            raise EvidenceError("--simulated-pki needs --quote-source simulated")
        served = events
        source = TdxQuoteSocketSource(tdx_quote_socket)
        return source, (lambda: served) if served is not None else None
    if kind == "configfs":
        if simulated_pki is not None:
            raise EvidenceError("--simulated-pki needs --quote-source simulated")
        fixed = events
        return ConfigfsTsmSource(), (lambda: fixed) if fixed is not None else None
    if kind == "azure":
        if simulated_pki is not None or events is not None:
            # Under the paravisor the guest cannot extend RTMRs: a served log would never replay.
            raise EvidenceError(
                "--quote-source azure takes neither --simulated-pki nor an event log"
            )
        return AzureVtpmSource(), None
    if simulated_pki is None:
        raise EvidenceError("--quote-source simulated needs --simulated-pki DIR")
    try:
        tdx = SimulatedTdx(SimulatedPki.load(simulated_pki), image=simulated_image)
    except (OSError, AttestError, ValueError) as exc:
        raise EvidenceError(f"{simulated_pki}: cannot load the simulated PKI: {exc}") from None
    for event in events or []:
        if event.name:  # runtime events only; the simulator adds its own boot events
            tdx.extend_runtime_event(event.name, event.payload, event.imr)
    return SimulatedSource(tdx), tdx.event_log
