"""Collateral relayed by the Security CVM's tunnel endpoint, through the real path:

    Forwarder (verifier from its config: `collateral: {relayed: true}`) ─aTLS─▶ TunnelEndpoint
    (its EVIDENCE carries the set a CollateralRelay fetched from a loopback PCCS)

The forwarder reaches no PCCS here (none is configured for it). A simulated TD quotes fresh per
session for the cases that must pass; the recorded Intel-signed quote and collateral
(tests/data/tdx) go through the same path, where only the session binding can fail (a recorded
quote cannot commit to this session's nonce). Every unfit set is refused before a header is sent,
with its reason counted and logged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.attest.conftest import DATA, T_INSIDE, release_for
from umbra.attest.atls import CollateralProvider
from umbra.attest.collateral import CollateralRelay, PccsCollateral, RelayedCollateral
from umbra.attest.measurement import ReleaseManifest
from umbra.attest.quote_source import QuoteSource, SimulatedSource
from umbra.attest.simpccs import SimulatedPccs
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.proxy.identity import CvmEntry, StaticIdentities, hash_credential
from umbra.proxy.startup import logged
from umbra.proxy.tunnel import TunnelEndpoint
from umbra.proxy.tunnel_identities import TunnelIdentities
from umbra.sandbox.forwarder import Forwarder
from umbra.sandbox.forwarder_config import ForwarderConfig
from umbra.sandbox.forwarder_setup import build_verifier
from umbra.sandbox.models import Endpoint

CVM, CREDENTIAL = "dev-alice-1", "collateral-relay-credential-0123"
CA_PEM = b"-----BEGIN CERTIFICATE-----\nnot parsed by the endpoint\n-----END CERTIFICATE-----\n"
REAL_QUOTE = (DATA / "tdx_quote").read_bytes()
REAL_SET = (DATA / "tdx_quote_collateral.json").read_bytes()
COMPOSE = bytes(range(32))


class RecordedQuote:
    """The recorded Intel-signed quote, whatever the session: its report_data cannot match."""

    simulated = False

    def get_quote(self, report_data: bytes) -> bytes:
        return REAL_QUOTE


def forwarder_config(
    tmp: Path, release: ReleaseManifest, pki: SimulatedPki | None
) -> ForwarderConfig:
    """A cloud Dev CVM's forwarder config: relayed collateral, nothing else to reach."""
    doc: dict[str, Any] = {
        "apiVersion": "umbra/v1",
        "kind": "ForwarderConfig",
        "listen": {"host": "127.0.0.1", "proxy_port": 3128},
        "security_cvm": {"host": "127.0.0.1", "port": 8443},
        "security_cvm_release": release.model_dump(mode="json", exclude_none=True),
        "collateral": {"relayed": True},
        "cvm_id_file": str(tmp / "cvm-id"),
    }
    if pki is not None:
        (tmp / "root.der").write_bytes(pki.root_der)
        doc |= {"allow_simulated": True, "simulated_root": str(tmp / "root.der")}
    return ForwarderConfig.model_validate(doc)


@asynccontextmanager
async def endpoint(
    tmp: Path, source: QuoteSource, collateral: CollateralProvider | None, log: Any = None
) -> AsyncIterator[tuple[TunnelEndpoint, int]]:
    (tmp / "ca.pem").write_bytes(CA_PEM)
    records: list[dict[str, Any]] = []
    ep = TunnelEndpoint(
        identities=StaticIdentities(
            [
                CvmEntry(
                    cvm_id=CVM,
                    owner="alice",
                    team="acme",
                    profiles=[],
                    credential_sha256=hash_credential(CREDENTIAL),
                )
            ]
        ),
        registry=TunnelIdentities(),
        proxy_host="127.0.0.1",
        proxy_port=9,
        emit=records.append,
        ca_file=tmp / "ca.pem",
        collateral=collateral,
    )
    server = await ep.serve("127.0.0.1", 0, source, log)
    try:
        yield ep, int(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        await server.wait_closed()


def forwarder(
    cfg: ForwarderConfig, port: int, clock: Callable[[], float] | None = None
) -> Forwarder:
    return Forwarder(
        cvm_id=CVM,
        security_cvm=Endpoint(host="127.0.0.1", port=port),
        verifier=build_verifier(cfg),
        listen_host="127.0.0.1",
        proxy_port=0,
        credential=CREDENTIAL,
        connect_timeout=5,
        handshake_timeout=20,
        clock=clock,
    )


@pytest.fixture(scope="module")
def pki() -> SimulatedPki:
    return SimulatedPki.generate()


@pytest.fixture
def tdx(pki: SimulatedPki) -> SimulatedTdx:
    tdx = SimulatedTdx(pki, image="umbra-security-cvm")
    tdx.extend_runtime_event("compose-hash", COMPOSE)
    return tdx


def release(tdx: SimulatedTdx) -> ReleaseManifest:
    return tdx.release_manifest(events=[{"name": "compose-hash", "payloads": [COMPOSE.hex()]}])


@pytest.fixture
def cfg(tmp_path: Path, tdx: SimulatedTdx, pki: SimulatedPki) -> ForwarderConfig:
    return forwarder_config(tmp_path, release(tdx), pki)


def _flip(data: bytes, index: int, bit: int = 0) -> bytes:
    out = bytearray(data)
    out[index] ^= 1 << bit
    return bytes(out)


async def test_relayed_collateral_verifies_through_the_tunnel_endpoint(
    tmp_path: Path, tdx: SimulatedTdx, pki: SimulatedPki, cfg: ForwarderConfig
) -> None:
    with SimulatedPccs(pki, int(time.time()) - 60) as pccs:
        relay = CollateralRelay(PccsCollateral([pccs.url]))
        async with endpoint(tmp_path, SimulatedSource(tdx), relay, tdx.event_log) as (ep, port):
            fwd = forwarder(cfg, port)
            for _ in range(3):
                assert await fwd.fetch_ca() == CA_PEM
    # One fetch by the Security CVM for three sessions; the forwarder parsed the set once.
    assert relay.fetches == 1 and relay.served == 3
    assert any(p.startswith("/tdx/certification/v4/tcb?fmspc=") for p in pccs.requests)
    source = fwd.verifier.collateral
    assert isinstance(source, RelayedCollateral)
    assert (source.misses, source.hits) == (1, 2)
    assert fwd.stats.refused == {} and ep.stats.ca_served == 3


def _constant(data: bytes | None) -> CollateralProvider:
    async def provide(quote: bytes) -> bytes | None:
        return data

    return provide


def _sets(pki: SimulatedPki) -> dict[str, bytes | None]:
    now = int(time.time())
    honest = pki.collateral(now - 60).json_text.encode()
    doc = json.loads(honest)
    doc["tcb_info_signature"] = doc["tcb_info_signature"][:-2] + "00"
    return {
        "missing": None,
        "oversized": honest + b" " * (300 * 1024),
        "malformed": b'{"pck_crl": "00"}',
        "wrong_fmspc": REAL_SET,  # Intel-signed, for another platform
        "stale": pki.collateral(now - 31 * 86400).json_text.encode(),
        "tampered": json.dumps(doc).encode(),
        "revoked": pki.collateral(now - 60, revoke_pck=True).json_text.encode(),
    }


@pytest.mark.parametrize(
    "reason", ["missing", "oversized", "malformed", "wrong_fmspc", "stale", "tampered", "revoked"]
)
async def test_unfit_relayed_collateral_refuses_the_session(
    tmp_path: Path,
    tdx: SimulatedTdx,
    pki: SimulatedPki,
    cfg: ForwarderConfig,
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    relayed = _sets(pki)[reason]
    async with endpoint(tmp_path, SimulatedSource(tdx), _constant(relayed), tdx.event_log) as (
        ep,
        port,
    ):
        fwd = forwarder(cfg, port)
        with caplog.at_level(logging.WARNING, logger="umbra.sandbox.forwarder"):
            assert await fwd.fetch_ca() is None
    assert fwd.stats.refused == {f"collateral_{reason}": 1}
    assert ep.stats.ca_served == 0  # refused before the header: the endpoint served nothing
    line = next(r.getMessage() for r in caplog.records if "not verified" in r.getMessage())
    assert f"collateral refused ({reason})" in line


async def test_bit_flips_in_the_relayed_set_never_pass(
    tmp_path: Path, tdx: SimulatedTdx, pki: SimulatedPki, cfg: ForwarderConfig
) -> None:
    honest = pki.collateral(int(time.time()) - 60).json_text.encode()
    served: list[bytes] = []
    step = len(honest) // 40

    async def flipping(quote: bytes) -> bytes | None:
        # Bits 0-6: the set stays ASCII, so it reaches the forwarder as sent (JSON text).
        served.append(_flip(honest, len(served) * step + 7, len(served) % 7))
        return served[-1]

    async with endpoint(tmp_path, SimulatedSource(tdx), flipping, tdx.event_log) as (ep, port):
        fwd = forwarder(cfg, port)
        results = [await fwd.fetch_ca() for _ in range(40)]
    assert results == [None] * 40 and ep.stats.ca_served == 0
    assert sum(fwd.stats.refused.values()) == 40
    assert all(key.startswith("collateral_") for key in fwd.stats.refused), fwd.stats.refused


async def test_pccs_down_the_relay_sends_nothing_and_the_forwarder_refuses(
    tmp_path: Path, tdx: SimulatedTdx, cfg: ForwarderConfig, caplog: pytest.LogCaptureFixture
) -> None:
    relay = CollateralRelay(PccsCollateral(["http://127.0.0.1:9"]))
    provider = logged(relay)  # as `umbra proxy serve --tunnel-collateral-pccs` wires it
    async with endpoint(tmp_path, SimulatedSource(tdx), provider, tdx.event_log) as (_, port):
        fwd = forwarder(cfg, port)
        with caplog.at_level(logging.WARNING):
            assert await fwd.fetch_ca() is None
            assert await fwd.fetch_ca() is None
    assert fwd.stats.refused == {"collateral_missing": 2}
    assert relay.last_error is not None and "127.0.0.1:9" in relay.last_error
    # The Security CVM says why, once (not once per handshake).
    said = [r.getMessage() for r in caplog.records if r.name == "umbra.proxy.startup"]
    assert len(said) == 1 and "fetch failed" in said[0] and "sending none" in said[0]


async def test_relay_renews_before_next_update_and_keeps_serving_while_the_pccs_is_down(
    pki: SimulatedPki, tdx: SimulatedTdx
) -> None:
    start = int(time.time())
    now = [float(start)]
    quote = tdx.quote(bytes(64))
    with SimulatedPccs(pki, start - 60) as pccs:
        relay = CollateralRelay(
            PccsCollateral([pccs.url]), refresh_margin=3600, retry_seconds=300, clock=lambda: now[0]
        )
        first = await relay(quote)
        assert first is not None and relay.fetches == 1
        assert await relay(quote) == first and relay.fetches == 1  # held: no fetch
        expires = json.loads(json.loads(first)["tcb_info"])["nextUpdate"]
        lapse = int(time.mktime(time.strptime(expires, "%Y-%m-%dT%H:%M:%SZ"))) - time.timezone
        now[0] = lapse - 1800  # inside the margin: renewed
        assert await relay(quote) is not None and relay.fetches == 2
    # The PCCS is gone: the held set is still served until it lapses, fetches are spaced.
    now[0] += 10
    assert await relay(quote) is not None and relay.fetches == 2  # tried too recently
    now[0] += 300
    assert await relay(quote) is not None and relay.fetches == 3 and relay.last_error
    now[0] = lapse
    assert await relay(quote) is None  # never a lapsed set


async def test_recorded_intel_quote_and_collateral_through_the_tunnel_endpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Production config (Intel root, no simulated root). The relayed Intel-signed set passes
    every collateral and DCAP check; only the session binding fails, as it must for a recorded
    quote. The same set with one byte changed is refused as tampered."""
    cfg = forwarder_config(tmp_path, release_for(REAL_QUOTE), None)
    with SimulatedPccs(
        None, collateral=RelayedCollateral().accept(REAL_QUOTE, REAL_SET, T_INSIDE)
    ) as pccs:
        relay = CollateralRelay(PccsCollateral([pccs.url]), clock=lambda: T_INSIDE)
        async with endpoint(tmp_path, RecordedQuote(), relay) as (_, port):
            fwd = forwarder(cfg, port, clock=lambda: T_INSIDE)
            with caplog.at_level(logging.WARNING, logger="umbra.sandbox.forwarder"):
                assert await fwd.fetch_ca() is None
    assert relay.fetches == 1
    assert fwd.stats.refused == {"attestation_failed": 1}
    line = next(r.getMessage() for r in caplog.records if "not verified" in r.getMessage())
    assert "report_data does not match" in line and "collateral" not in line

    index = REAL_SET.index(b"tcb_info_signature") + 40
    async with endpoint(tmp_path, RecordedQuote(), _constant(_flip(REAL_SET, index))) as (_, port):
        fwd = forwarder(cfg, port, clock=lambda: T_INSIDE)
        assert await fwd.fetch_ca() is None
    assert fwd.stats.refused == {"collateral_tampered": 1}


async def test_production_forwarder_refuses_a_simulated_security_cvm(
    tmp_path: Path, tdx: SimulatedTdx, pki: SimulatedPki, caplog: pytest.LogCaptureFixture
) -> None:
    """Relayed collateral for a simulated TD, production forwarder config: refused (policy)."""
    production = release(tdx).model_copy(update={"tee": "tdx"})
    cfg = forwarder_config(tmp_path, production, None)
    honest = pki.collateral(int(time.time()) - 60).json_text.encode()
    async with endpoint(tmp_path, SimulatedSource(tdx), _constant(honest), tdx.event_log) as (
        _,
        port,
    ):
        fwd = forwarder(cfg, port)
        with caplog.at_level(logging.WARNING, logger="umbra.sandbox.forwarder"):
            assert await fwd.fetch_ca() is None
    line = next(r.getMessage() for r in caplog.records if "not verified" in r.getMessage())
    assert "Intel SGX Root CA" in line
    # And the config that would admit the simulated root needs a simulated release.
    with pytest.raises(ValueError, match="allow_simulated needs a security_cvm_release"):
        forwarder_config(tmp_path, production, pki)


def test_collateral_config_is_exactly_one_source(tmp_path: Path, tdx: SimulatedTdx) -> None:
    cfg = forwarder_config(tmp_path, release(tdx), None).model_dump(mode="json")
    for collateral in ({}, {"relayed": True, "pccs_urls": ["https://pccs.example"]},
                       {"relayed": False}):  # fmt: skip
        with pytest.raises(ValueError, match="exactly one of pccs_urls, file or relayed"):
            ForwarderConfig.model_validate({**cfg, "collateral": collateral})
