"""The tunnel endpoint's evidence sources: Azure goes through the vTPM envelope, never a log."""

from __future__ import annotations

from pathlib import Path

import pytest

from umbra.attest.azure_source import AzureVtpmSource
from umbra.proxy.tunnel_quote import EvidenceError, build_evidence


def test_azure_quote_source_is_the_vtpm_envelope_without_an_event_log() -> None:
    source, log = build_evidence("azure")
    assert isinstance(source, AzureVtpmSource) and not source.simulated
    assert log is None


def test_azure_refuses_simulated_inputs_and_event_logs(tmp_path: Path) -> None:
    with pytest.raises(EvidenceError, match="neither --simulated-pki nor an event log"):
        build_evidence("azure", simulated_pki=tmp_path)
    log = tmp_path / "log.json"
    log.write_text("[]")
    with pytest.raises(EvidenceError, match="neither --simulated-pki nor an event log"):
        build_evidence("azure", event_log=log)
