"""Shared fixtures: the real Intel-signed vectors (tests/data/tdx) and a simulated TEE."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from umbra.attest.collateral import Collateral
from umbra.attest.measurement import MeasurementPolicy, ReleaseManifest
from umbra.attest.quote import parse_quote
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx

DATA = Path(__file__).resolve().parent.parent / "data" / "tdx"
# Inside the real tdx_quote collateral's window: after every issue date, before the first expiry.
T_INSIDE = 1752919234
T_SIM = 1_800_000_000  # the simulated collateral is issued an hour before this


def release_for(raw: bytes, **extra: Any) -> ReleaseManifest:
    """A release manifest pinning exactly the measurements found in `raw`."""
    td = parse_quote(raw).td_report
    return ReleaseManifest.model_validate(
        {
            "apiVersion": "umbra/v1",
            "kind": "ReleaseManifest",
            "name": "test-release",
            "tee": "tdx",
            "mrtd": [td.mr_td.hex()],
            "rtmr0": [td.rtmrs[0].hex()],
            "rtmr1": [td.rtmrs[1].hex()],
            "rtmr2": [td.rtmrs[2].hex()],
            **extra,
        }
    )


@pytest.fixture(scope="session")
def real_quote() -> bytes:
    return (DATA / "tdx_quote").read_bytes()


@pytest.fixture(scope="session")
def real_collateral() -> Collateral:
    return Collateral.from_file(DATA / "tdx_quote_collateral.json")


@pytest.fixture(scope="session")
def outdated_quote() -> bytes:
    return (DATA / "tdx_quote_outdated").read_bytes()


@pytest.fixture(scope="session")
def outdated_collateral() -> Collateral:
    return Collateral.from_file(DATA / "tdx_quote_outdated_collateral.json")


@pytest.fixture(scope="session")
def dstack_report() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DATA / "dstack_quote_report.json").read_text())
    return doc


@pytest.fixture(scope="session")
def real_policy(real_quote: bytes) -> MeasurementPolicy:
    return MeasurementPolicy(release=release_for(real_quote))


@pytest.fixture(scope="session")
def pki() -> SimulatedPki:
    return SimulatedPki.generate()


@pytest.fixture(scope="session")
def sim_collateral(pki: SimulatedPki) -> Collateral:
    return pki.collateral(T_SIM - 3600)


@pytest.fixture
def tdx(pki: SimulatedPki) -> SimulatedTdx:
    return SimulatedTdx(pki)
