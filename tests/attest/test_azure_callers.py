"""The callers' entry points take Azure evidence unchanged: the Console's secret release is
driven here with a simulated Azure Security CVM, with no change to its code."""

from __future__ import annotations

import base64
import os

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from umbra.attest.collateral import Collateral, StaticCollateral
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simazure import SimulatedAzureCvm
from umbra.attest.simpki import SimulatedPki
from umbra.attest.verify import Verifier
from umbra.console.release import AttestedReleaseVerifier, ReleaseEvidence, ReleaseRefused
from umbra.contracts.release import expected_report_data


def test_console_release_accepts_azure_evidence(
    pki: SimulatedPki, sim_collateral: Collateral, monkeypatch: pytest.MonkeyPatch
) -> None:
    from .conftest import T_SIM

    monkeypatch.setattr("time.time", lambda: float(T_SIM))  # the release verifies "now"
    cvm = SimulatedAzureCvm(pki)
    verifier = Verifier(
        MeasurementPolicy(release=cvm.release_manifest()),
        StaticCollateral(sim_collateral),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    release = AttestedReleaseVerifier(verifier)
    public = X25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    nonce = base64.urlsafe_b64encode(os.urandom(24)).decode()
    evidence = cvm.source().get_quote(expected_report_data(nonce, "scvm-1", public))

    def doc(security_cvm_nonce: str) -> ReleaseEvidence:
        return ReleaseEvidence(
            nonce=security_cvm_nonce,
            quote=base64.b64encode(evidence).decode(),
            public_key=base64.b64encode(public).decode(),
        )

    key = release.verify(doc(nonce), "scvm-1")
    assert key.public_bytes(Encoding.Raw, PublicFormat.Raw) == public
    with pytest.raises(ReleaseRefused, match="user-data does not match"):
        release.verify(doc(nonce), "scvm-2")  # bound to another Security CVM's id
