"""Quote parsing: both real vectors, simulated v4/v5, cross-checked against dcap-qvl's parser."""

from __future__ import annotations

import struct

import dcap_qvl
import pytest

from umbra.attest.errors import QuoteParseError
from umbra.attest.quote import TdReportVersion, parse_quote
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx


def _cross_check(raw: bytes) -> None:
    ours = parse_quote(raw)
    theirs = dcap_qvl.parse_quote(raw)
    assert ours.header.version == theirs.header.version
    assert ours.header.tee_type == theirs.header.tee_type
    assert ours.header.qe_vendor_id == bytes(theirs.header.qe_vendor_id)
    assert ours.header.user_data == bytes(theirs.header.user_data)
    rep = theirs.report
    td = ours.td_report
    assert td.tee_tcb_svn == bytes(rep.tee_tcb_svn)
    assert td.mr_seam == bytes(rep.mr_seam)
    assert td.mr_signer_seam == bytes(rep.mr_signer_seam)
    assert td.seam_attributes == bytes(rep.seam_attributes)
    assert td.td_attributes == bytes(rep.td_attributes)
    assert td.xfam == bytes(rep.xfam)
    assert td.mr_td == bytes(rep.mr_td)
    assert td.mr_config_id == bytes(rep.mr_config_id)
    assert td.mr_owner == bytes(rep.mr_owner)
    assert td.mr_owner_config == bytes(rep.mr_owner_config)
    assert td.rtmrs == (
        bytes(rep.rt_mr0),
        bytes(rep.rt_mr1),
        bytes(rep.rt_mr2),
        bytes(rep.rt_mr3),
    )
    assert td.report_data == bytes(rep.report_data)
    if td.version is TdReportVersion.TD15:
        assert td.tee_tcb_svn2 == bytes(rep.tee_tcb_svn2)
        assert td.mr_service_td == bytes(rep.mr_service_td)
    assert ours.pck_chain_pem.rstrip(b"\0") == bytes(theirs.cert_chain_pem_bytes()).rstrip(b"\0")


def test_real_v4_quote_matches_dcap_qvl(real_quote: bytes) -> None:
    q = parse_quote(real_quote)
    assert (q.header.version, q.td_report.version) == (4, TdReportVersion.TD10)
    assert q.padding > 0
    assert real_quote.endswith(bytes(q.padding))
    _cross_check(real_quote)


def test_real_v5_quote_is_td15_and_matches_dcap_qvl(outdated_quote: bytes) -> None:
    q = parse_quote(outdated_quote)
    assert (q.header.version, q.body_type, q.td_report.version) == (5, 3, TdReportVersion.TD15)
    _cross_check(outdated_quote)


@pytest.mark.parametrize("version", [4, 5])
def test_simulated_quotes_match_dcap_qvl(pki: SimulatedPki, version: int) -> None:
    tdx = SimulatedTdx(pki, version=version)
    raw = tdx.quote(b"\x42" * 64)
    _cross_check(raw)
    q = parse_quote(raw)
    assert q.td_report.report_data == b"\x42" * 64
    assert q.td_report.rtmrs == tdx.rtmrs()


def test_v5_td10_body_parses(pki: SimulatedPki) -> None:
    raw = SimulatedTdx(pki, version=4).quote(b"")
    # Re-wrap the v4 body as a v5 quote with body type 2 (TD report 1.0).
    header = struct.pack("<H", 5) + raw[2:48]
    v5 = header + struct.pack("<HI", 2, 584) + raw[48:]
    q = parse_quote(v5)
    assert (q.header.version, q.td_report.version) == (5, TdReportVersion.TD10)


def _err(raw: bytes) -> QuoteParseError:
    with pytest.raises(QuoteParseError) as info:
        parse_quote(raw)
    return info.value


def test_truncation_names_the_field(real_quote: bytes) -> None:
    assert _err(real_quote[:10]).field.startswith("header.")
    assert _err(real_quote[:100]).field == "td_report.mr_seam"
    e = _err(real_quote[:700])
    assert e.field == "signature_data.size"
    assert "claims" in str(e)


def test_wrong_version_tee_and_key_type(real_quote: bytes) -> None:
    assert _err(struct.pack("<H", 3) + real_quote[2:]).field == "header.version"
    assert _err(real_quote[:2] + struct.pack("<H", 3) + real_quote[4:]).field == (
        "header.attestation_key_type"
    )
    sgx = real_quote[:4] + struct.pack("<I", 0) + real_quote[8:]
    e = _err(sgx)
    assert e.field == "header.tee_type"
    assert e.offset == 4


def test_v5_body_size_and_type_checked(outdated_quote: bytes) -> None:
    bad_size = outdated_quote[:50] + struct.pack("<I", 584) + outdated_quote[54:]
    assert _err(bad_size).field == "body.size"
    sgx_body = outdated_quote[:48] + struct.pack("<H", 1) + outdated_quote[50:]
    assert _err(sgx_body).field == "body.type"


def test_trailing_garbage_is_refused_but_zero_padding_allowed(real_quote: bytes) -> None:
    q = parse_quote(real_quote + bytes(16))
    assert q.padding == parse_quote(real_quote).padding + 16
    e = _err(real_quote + b"\x01")
    assert e.field == "trailing_padding"
    assert e.offset == len(real_quote)


def test_non_canonical_pem_is_refused(real_quote: bytes) -> None:
    q = parse_quote(real_quote)
    start = real_quote.index(q.pck_chain_pem)
    # Replace one '\n' inside the first certificate by '\r': same certificates, other bytes.
    nl = real_quote.index(b"\n", start + 40)
    tampered = real_quote[:nl] + b"\r" + real_quote[nl + 1 :]
    assert _err(tampered).field == "pck_cert_data.chain"


def test_oversized_and_non_bytes_input() -> None:
    assert _err(bytes(70_000)).field == "quote"
    with pytest.raises(QuoteParseError):
        parse_quote("not bytes")  # type: ignore[arg-type]


def test_debug_bit_is_read(pki: SimulatedPki) -> None:
    assert not parse_quote(SimulatedTdx(pki).quote(b"")).td_report.debug
    assert parse_quote(SimulatedTdx(pki, debug=True).quote(b"")).td_report.debug
