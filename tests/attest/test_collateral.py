"""Collateral: files, PCCS endpoints tried in turn, cache per (PCCS, FMSPC, CA) with expiry."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from umbra.attest.collateral import Collateral, CollateralCache, PccsCollateral
from umbra.attest.errors import CollateralError
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpccs import SimulatedPccs
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verifier

from .conftest import T_SIM


class FakePccs:
    """Stands in for dcap_qvl.get_collateral: per-URL answers, counting calls."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    async def __call__(self, url: str, raw_quote: bytes) -> Any:
        self.calls.append(url)
        await asyncio.sleep(0)
        answer = self.answers[url]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_collateral_dates(real_collateral: Collateral) -> None:
    assert real_collateral.fmspc == "B0C06F000000"
    assert real_collateral.issue_date <= real_collateral.tcb_info_issue_date
    assert real_collateral.next_update > real_collateral.issue_date


@pytest.mark.parametrize(
    ("text", "needle"),
    [("[]", "JSON object"), ("{}", "lacks"), ("nope", "not JSON")],
)
def test_bad_collateral(text: str, needle: str) -> None:
    with pytest.raises(CollateralError, match=needle):
        Collateral.from_json(text)


def test_endpoints_tried_in_turn_and_cached(real_quote: bytes, real_collateral: Collateral) -> None:
    fake = FakePccs(
        {
            "https://a.example": ValueError("connection refused"),
            "https://b.example": real_collateral.qvl,
        }
    )
    src = PccsCollateral(["https://a.example/", "https://b.example"], fetch=fake)
    now = real_collateral.issue_date + 60
    got = src.collateral_for(real_quote, now)
    assert got.fmspc == "B0C06F000000"
    assert fake.calls == ["https://a.example", "https://b.example"]
    # Second call: b's fresh cache entry answers; nobody is asked.
    src.collateral_for(real_quote, now + 1)
    assert fake.calls == ["https://a.example", "https://b.example"]
    # After the collateral's nextUpdate the entry has expired: both are asked again, in order.
    src.collateral_for(real_quote, real_collateral.next_update + 1)
    assert fake.calls[2:] == ["https://a.example", "https://b.example"]


def test_all_endpoints_failing_reports_each(real_quote: bytes) -> None:
    fake = FakePccs({"https://a": ValueError("boom"), "https://b": RuntimeError("timeout")})
    src = PccsCollateral(["https://a", "https://b"], fetch=fake)
    with pytest.raises(CollateralError, match=r"https://a: boom; https://b: timeout"):
        src.collateral_for(real_quote, 1752919234)


def test_cache_is_per_pccs_and_persists(
    tmp_path: Path, real_quote: bytes, real_collateral: Collateral
) -> None:
    cache = CollateralCache(tmp_path / "cache")
    now = real_collateral.issue_date + 60
    fake = FakePccs({"https://a": real_collateral.qvl, "https://b": real_collateral.qvl})
    PccsCollateral(["https://a"], cache=cache, fetch=fake).collateral_for(real_quote, now)
    PccsCollateral(["https://b"], cache=cache, fetch=fake).collateral_for(real_quote, now)
    assert fake.calls == ["https://a", "https://b"]
    # A new process (new cache object, same directory) finds the entry on disk.
    fresh = PccsCollateral(["https://a"], cache=CollateralCache(tmp_path / "cache"), fetch=fake)
    fresh.collateral_for(real_quote, now)
    assert fake.calls == ["https://a", "https://b"]
    # A damaged cache file is a miss, not an error.
    for f in (tmp_path / "cache").iterdir():
        f.write_text("garbage")
    fresh2 = PccsCollateral(["https://a"], cache=CollateralCache(tmp_path / "cache"), fetch=fake)
    fresh2.collateral_for(real_quote, now)
    assert fake.calls[-1] == "https://a"


def test_max_ttl_bounds_cache_lifetime(real_quote: bytes, real_collateral: Collateral) -> None:
    fake = FakePccs({"https://a": real_collateral.qvl})
    src = PccsCollateral(["https://a"], fetch=fake, max_ttl_seconds=100)
    now = real_collateral.issue_date + 60
    src.collateral_for(real_quote, now)
    src.collateral_for(real_quote, now + 99)
    assert len(fake.calls) == 1
    src.collateral_for(real_quote, now + 100)
    assert len(fake.calls) == 2


def _dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here any more: connection refused
    return f"http://127.0.0.1:{port}"


def test_real_dcap_qvl_fetch_from_local_pccs(pki: SimulatedPki) -> None:
    """dcap-qvl's own HTTP client fetches from the simulated PCCS after a dead endpoint."""
    tdx = SimulatedTdx(pki)
    raw = tdx.quote(b"")
    with SimulatedPccs(pki, T_SIM - 3600) as pccs:
        src = PccsCollateral([_dead_url(), pccs.url])
        policy = MeasurementPolicy(release=tdx.release_manifest())
        verifier = Verifier(policy, src, allow_simulated=True, simulated_root_der=pki.root_der)
        v = verifier.verify(raw, now=T_SIM)
        assert v.ok, v.reasons
        assert any(p.startswith("/tdx/certification/v4/tcb?fmspc=") for p in pccs.requests)
        served = len(pccs.requests)
        assert verifier.verify(raw, now=T_SIM + 60).ok
        assert len(pccs.requests) == served  # answered from the cache
