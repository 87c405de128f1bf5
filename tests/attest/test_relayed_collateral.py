"""Collateral relayed by the attested peer: the recorded Intel-signed quote and collateral
(tests/data/tdx) verify exactly as from a PCCS, and every way the relayed bytes can be wrong is
refused with its own reason, whichever bit of them is changed."""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from umbra.attest.collateral import (
    MAX_RELAYED_COLLATERAL,
    RELAYED_CACHE_ENTRIES,
    Collateral,
    CollateralRelay,
    PccsCollateral,
    RelayedCollateral,
    StaticCollateral,
)
from umbra.attest.errors import CollateralRefusal
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Step, Verifier

from .conftest import DATA, T_INSIDE, T_SIM

RAW = (DATA / "tdx_quote_collateral.json").read_bytes()


@pytest.fixture
def relayed(real_policy: MeasurementPolicy) -> Verifier:
    return Verifier(real_policy, RelayedCollateral())


def _flip(data: bytes, index: int, bit: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 1 << bit
    return bytes(out)


def _field_flip(field: str, old: str, new: str) -> bytes:
    doc = json.loads(RAW)
    assert old in doc[field]
    doc[field] = doc[field].replace(old, new, 1)
    return json.dumps(doc, indent=2).encode()


def test_real_collateral_relayed_verifies_as_from_a_pccs(
    relayed: Verifier, real_quote: bytes, real_policy: MeasurementPolicy
) -> None:
    verdict = relayed.verify(real_quote, now=T_INSIDE, relayed_collateral=RAW)
    assert verdict.ok, verdict.reasons
    static = Verifier(real_policy, StaticCollateral(Collateral.from_json(RAW)))
    reference = static.verify(real_quote, now=T_INSIDE)
    assert (verdict.tcb_status, verdict.advisory_ids) == (
        reference.tcb_status,
        reference.advisory_ids,
    )
    # The same bytes again: parsed once (the cache), verified again all the same.
    source = relayed.collateral
    assert isinstance(source, RelayedCollateral)
    assert relayed.verify(real_quote, now=T_INSIDE, relayed_collateral=RAW).ok
    assert (source.misses, source.hits) == (1, 1)


def test_relayed_bytes_are_ignored_by_a_pccs_or_file_verifier(
    real_quote: bytes, real_policy: MeasurementPolicy, real_collateral: Collateral
) -> None:
    verifier = Verifier(real_policy, StaticCollateral(real_collateral))
    assert verifier.verify(real_quote, now=T_INSIDE, relayed_collateral=b"garbage").ok


@pytest.mark.parametrize(
    ("relayed_bytes", "refusal", "needle"),
    [
        (None, CollateralRefusal.MISSING, "sent no collateral"),
        (b" " * (MAX_RELAYED_COLLATERAL + 1), CollateralRefusal.OVERSIZED, "more than the"),
        (b"{not json", CollateralRefusal.MALFORMED, "not JSON"),
        (b'{"tcb_info": "{}"}', CollateralRefusal.MALFORMED, "lacks"),
        # Intel-signed, but for the other recorded platform (FMSPC 90C06F000000).
        (
            (DATA / "tdx_quote_outdated_collateral.json").read_bytes(),
            CollateralRefusal.WRONG_FMSPC,
            "FMSPC 90C06F000000",
        ),
    ],
)
def test_unfit_relayed_collateral_is_refused_with_its_reason(
    relayed: Verifier,
    real_quote: bytes,
    relayed_bytes: bytes | None,
    refusal: CollateralRefusal,
    needle: str,
) -> None:
    verdict = relayed.verify(real_quote, now=T_INSIDE, relayed_collateral=relayed_bytes)
    assert not verdict.ok
    assert verdict.collateral_refusal is refusal
    assert verdict.failed_steps == [Step.COLLATERAL]
    assert needle in verdict.reasons[0]
    assert verdict.to_json()["collateral_refusal"] == refusal.value


def test_stale_relayed_collateral_is_refused(relayed: Verifier, real_quote: bytes) -> None:
    collateral = Collateral.from_json(RAW)
    for when in (collateral.expires_at, collateral.expires_at + 86400, collateral.issue_date - 1):
        verdict = relayed.verify(real_quote, now=when, relayed_collateral=RAW)
        assert verdict.collateral_refusal is CollateralRefusal.STALE, when
        assert not verdict.ok


@pytest.mark.parametrize(
    ("field", "old", "new"),
    [
        # dcap-qvl never reads this chain: before the collateral check a changed byte here passed.
        ("pck_crl_issuer_chain", "MIIC", "MIIB"),
        # Same certificate after decoding (a form feed for a newline): refused as non-canonical.
        ("tcb_info_issuer_chain", "\n", "\f"),
        # Same signature bytes after decoding (upper-case hex).
        ("tcb_info_signature", "a", "A"),
        ("pck_crl", "a", "A"),
        ("qe_identity", '"TD_QE"', '"TD_QF"'),
        ("tcb_info", '"TDX"', '"TDY"'),
    ],
)
def test_changed_bytes_that_decode_alike_are_refused_too(
    relayed: Verifier,
    real_quote: bytes,
    real_policy: MeasurementPolicy,
    field: str,
    old: str,
    new: str,
) -> None:
    changed = _field_flip(field, old, new)
    verdict = relayed.verify(real_quote, now=T_INSIDE, relayed_collateral=changed)
    assert verdict.collateral_refusal is CollateralRefusal.TAMPERED, verdict.reasons
    assert field.removesuffix("_signature") in verdict.reasons[0]
    # A PCCS answer (or a file) carrying the same bytes is refused the same way.
    static = Verifier(real_policy, StaticCollateral(Collateral.from_json(changed)))
    assert static.verify(real_quote, now=T_INSIDE).collateral_refusal is CollateralRefusal.TAMPERED


def test_signature_unused_bits_changed_is_refused(relayed: Verifier, real_quote: bytes) -> None:
    """The Platform CA's signature BIT STRING says 1 unused bit instead of 0: the same validly
    signed certificate to `cryptography`, a changed byte all the same (the one flip the full
    sweep found passing). The TCB signing certificate's signature ends in a set bit, so the same
    edit there does not even parse."""
    field = "pck_crl_issuer_chain"
    doc = json.loads(RAW)
    certs = x509.load_pem_x509_certificates(doc[field].encode())
    der = bytearray(certs[0].public_bytes(Encoding.DER))
    # The last BIT STRING (03 len 00 30...): the ECDSA signature, unused bits 0.
    at = [m.start() for m in re.finditer(rb"\x03[\x40-\x4a]\x000", bytes(der))][-1] + 2
    der[at] = 1
    edited = x509.load_der_x509_certificate(bytes(der))
    doc[field] = "".join(c.public_bytes(Encoding.PEM).decode() for c in [edited, *certs[1:]])
    verdict = relayed.verify(real_quote, now=T_INSIDE, relayed_collateral=json.dumps(doc).encode())
    assert verdict.collateral_refusal is CollateralRefusal.TAMPERED, verdict.reasons
    assert field in verdict.reasons[0]


def test_bit_flips_anywhere_in_the_relayed_collateral_are_refused(
    relayed: Verifier, real_quote: bytes
) -> None:
    """A sample of single-bit flips over the whole document (every bit of every byte was swept
    once by hand; see docs/specs/attestation.md): none verifies, each with a reason."""
    rng = random.Random(22)
    positions = sorted(rng.sample(range(len(RAW)), 400))
    reasons: dict[CollateralRefusal | None, int] = {}
    for index in positions:
        for bit in (0, 5):
            verdict = relayed.verify(
                real_quote, now=T_INSIDE, relayed_collateral=_flip(RAW, index, bit)
            )
            assert not verdict.ok, (index, bit, RAW[max(0, index - 16) : index + 4])
            reasons[verdict.collateral_refusal] = reasons.get(verdict.collateral_refusal, 0) + 1
    assert None not in reasons, "a refusal without its collateral reason"
    assert reasons[CollateralRefusal.TAMPERED] > 0 and reasons[CollateralRefusal.MALFORMED] > 0


def test_collateral_for_another_root_is_refused(
    relayed: Verifier, real_quote: bytes, pki: SimulatedPki
) -> None:
    """A set signed by some other root (here a simulated PKI, FMSPC edited to match) never
    verifies against the pinned Intel root."""
    doc = json.loads(pki.collateral(T_INSIDE - 3600).json_text)
    doc["tcb_info"] = doc["tcb_info"].replace(json.loads(doc["tcb_info"])["fmspc"], "B0C06F000000")
    verdict = relayed.verify(real_quote, now=T_INSIDE, relayed_collateral=json.dumps(doc).encode())
    assert verdict.collateral_refusal is CollateralRefusal.TAMPERED
    assert "does not end in the pinned root CA" in verdict.reasons[0]


def test_revoked_pck_is_refused(pki: SimulatedPki) -> None:
    tdx = SimulatedTdx(pki)
    policy = MeasurementPolicy(release=tdx.release_manifest())
    verifier = Verifier(
        policy, RelayedCollateral(), allow_simulated=True, simulated_root_der=pki.root_der
    )
    quote = tdx.quote(bytes(64))
    good = pki.collateral(T_SIM - 3600).json_text.encode()
    assert verifier.verify(quote, now=T_SIM, relayed_collateral=good).ok
    revoked = pki.collateral(T_SIM - 3600, revoke_pck=True).json_text.encode()
    verdict = verifier.verify(quote, now=T_SIM, relayed_collateral=revoked)
    assert verdict.collateral_refusal is CollateralRefusal.REVOKED
    assert "pck_crl revokes the quote's PCK certificate" in verdict.reasons[0]


def test_production_verifier_refuses_the_simulated_root(pki: SimulatedPki) -> None:
    """Relayed collateral changes nothing about simulated quotes: without allow_simulated (the
    production forwarder's config), a simulated quote with its own relayed set is refused."""
    tdx = SimulatedTdx(pki)
    policy = MeasurementPolicy(release=tdx.release_manifest())
    verifier = Verifier(policy, RelayedCollateral())
    verdict = verifier.verify(
        tdx.quote(bytes(64)),
        now=T_SIM,
        relayed_collateral=pki.collateral(T_SIM - 3600).json_text.encode(),
    )
    assert not verdict.ok and verdict.failed_steps == [Step.POLICY]


def test_parsed_sets_cache_is_bounded(real_quote: bytes) -> None:
    source = RelayedCollateral()
    for i in range(RELAYED_CACHE_ENTRIES * 3):
        source.accept(real_quote, RAW + b" " * i, T_INSIDE)  # distinct bytes, same set
    assert len(source._parsed) == RELAYED_CACHE_ENTRIES
    assert source.misses == RELAYED_CACHE_ENTRIES * 3


async def test_relay_serves_the_held_set_while_one_handshake_renews(
    pki: SimulatedPki, tdx: SimulatedTdx
) -> None:
    """Held, then renewed inside the margin by one caller while the others keep getting the
    held set without waiting. (A simulated set: the recorded Intel set's window between its
    last issue date and its first lapse is one second.)"""
    collateral = pki.collateral(T_SIM - 3600)
    expected = Collateral.from_qvl(collateral.qvl).json_text.encode()  # as a PCCS answer reads
    quote = tdx.quote(bytes(64))
    gate = asyncio.Event()
    calls: list[str] = []

    async def fetch(url: str, raw_quote: bytes) -> Any:
        calls.append(url)
        if len(calls) > 1:
            await gate.wait()
        return collateral.qvl

    now = [float(T_SIM)]
    relay = CollateralRelay(
        PccsCollateral(["https://pccs.invalid"], fetch=fetch),
        refresh_margin=3600,
        clock=lambda: now[0],
    )
    assert await relay(quote) == expected
    now[0] = collateral.expires_at - 600  # inside the margin: the next caller renews
    renewing = asyncio.create_task(relay(quote))
    await asyncio.sleep(0.01)
    assert len(calls) == 2 and not renewing.done()
    assert await relay(quote) == expected  # not held up
    gate.set()
    assert await renewing == expected
    assert relay.fetches == 2


def test_pccs_cache_entry_lapses_with_the_sets_first_crl(real_quote: bytes) -> None:
    """The recorded set's CRLs lapse before its TCB info (`expires_at` < `next_update`): the
    cache (the relay's source) must not keep handing it out past that (it did until issue 22,
    so a relay renewing inside its margin got the lapsed set back)."""
    collateral = Collateral.from_json(RAW)
    assert collateral.expires_at < collateral.next_update
    calls: list[str] = []

    async def fetch(url: str, raw_quote: bytes) -> Any:
        calls.append(url)
        return collateral.qvl

    source = PccsCollateral(["https://pccs.invalid"], fetch=fetch)
    source.collateral_for(real_quote, collateral.expires_at - 100)
    source.collateral_for(real_quote, collateral.expires_at - 1)
    assert len(calls) == 1  # a fresh entry answers
    source.collateral_for(real_quote, collateral.expires_at)
    assert len(calls) == 2  # lapsed with its CRL: fetched again
