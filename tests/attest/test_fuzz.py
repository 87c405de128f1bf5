"""Hypothesis fuzzing of every parser: arbitrary input yields a result or our own error."""

from __future__ import annotations

import base64
import contextlib
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umbra.attest.atls import _decode_evidence
from umbra.attest.azure import AzureEvidence, decode_envelope, parse_hcl_report
from umbra.attest.collateral import Collateral
from umbra.attest.errors import (
    ATLSError,
    AttestError,
    CollateralError,
    EventLogError,
    QuoteParseError,
)
from umbra.attest.eventlog import dump_ccel, parse_ccel, parse_dstack_event_log
from umbra.attest.inputs import decode_evidence
from umbra.attest.quote import parse_quote
from umbra.attest.tpm import parse_tpm_quote

from .conftest import DATA

REAL = (DATA / "tdx_quote").read_bytes()
REAL_V5 = (DATA / "tdx_quote_outdated").read_bytes()
DSTACK_LOG = json.loads((DATA / "dstack_quote_report.json").read_text())["event_log"]
CCEL = dump_ccel(parse_dstack_event_log(DSTACK_LOG))

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mutated(draw: st.DrawFn, base: bytes) -> bytes:
    """Real input with random byte edits, truncation or insertion: reaches deep code paths."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "cut":
            data = data[:pos]
        else:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


def _parse_quote(raw: bytes) -> None:
    error: QuoteParseError | None = None
    try:
        q = parse_quote(raw)
    except QuoteParseError as exc:
        error = exc
    if error is None:
        assert len(q.td_report.report_data) == 64
    else:
        assert error.field
        assert 0 <= error.offset <= len(raw)


@FUZZ
@given(st.binary(max_size=6000))
def test_quote_parser_random_bytes(raw: bytes) -> None:
    _parse_quote(raw)


@FUZZ
@given(st.one_of(mutated(REAL), mutated(REAL_V5)))
def test_quote_parser_mutated_real_quotes(raw: bytes) -> None:
    _parse_quote(raw)


@FUZZ
@given(mutated(CCEL))
def test_ccel_parser(raw: bytes) -> None:
    with contextlib.suppress(EventLogError):
        parse_ccel(raw)


@FUZZ
@given(st.binary(max_size=2000))
def test_ccel_parser_random(raw: bytes) -> None:
    with contextlib.suppress(EventLogError):
        parse_ccel(raw)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=30,
)
_event = st.fixed_dictionaries(
    {},
    optional={
        "imr": st.one_of(st.integers(-2, 6), st.text(max_size=3)),
        "event_type": st.one_of(st.integers(-1, 2**33), st.sampled_from([4, 0x08000001])),
        "digest": st.one_of(st.text(max_size=10), st.binary(max_size=48).map(bytes.hex)),
        "event": st.one_of(st.text(max_size=10), st.integers()),
        "event_payload": st.one_of(st.text(max_size=10), st.binary(max_size=16).map(bytes.hex)),
    },
)


@FUZZ
@given(st.one_of(_json, st.lists(_event, max_size=5)))
def test_dstack_log_parser(doc: object) -> None:
    with contextlib.suppress(EventLogError):
        parse_dstack_event_log(json.dumps(doc))


@FUZZ
@given(mutated(DSTACK_LOG.encode()))
def test_dstack_log_parser_mutated(raw: bytes) -> None:
    with contextlib.suppress(EventLogError):
        parse_dstack_event_log(raw)


@FUZZ
@given(st.one_of(_json.map(json.dumps), st.text(max_size=200)))
def test_collateral_parser(text: str) -> None:
    with contextlib.suppress(CollateralError):
        Collateral.from_json(text)


def test_errors_share_one_base() -> None:
    for exc in (QuoteParseError, EventLogError, CollateralError):
        assert issubclass(exc, AttestError)


REAL_COLLATERAL = json.loads((DATA / "tdx_quote_collateral.json").read_text())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(st.sampled_from(sorted(REAL_COLLATERAL)), _json, max_size=4),
    st.sampled_from(["tcb_info", "qe_identity"]),
    st.dictionaries(st.sampled_from(["issueDate", "nextUpdate", "fmspc"]), _json, max_size=2),
)
def test_collateral_parser_field_mutations(
    overrides: dict[str, object], inner: str, inner_overrides: dict[str, object]
) -> None:
    doc = dict(REAL_COLLATERAL)
    inner_doc = json.loads(doc[inner])
    inner_doc.update(inner_overrides)
    doc[inner] = json.dumps(inner_doc)
    doc.update(overrides)
    with contextlib.suppress(CollateralError):
        Collateral.from_json(json.dumps(doc))


_evidence_doc = st.one_of(
    _json,
    st.fixed_dictionaries(
        {
            "quote": st.one_of(
                st.text(max_size=30),
                st.binary(max_size=30).map(lambda b: base64.b64encode(b).decode()),
            )
        },
        optional={
            "event_log": st.one_of(st.none(), st.text(max_size=30), st.just(DSTACK_LOG), _json)
        },
    ),
)


@FUZZ
@given(st.one_of(_evidence_doc.map(lambda d: json.dumps(d).encode()), st.binary(max_size=200)))
def test_atls_evidence_decoder(payload: bytes) -> None:
    with contextlib.suppress(ATLSError):
        _decode_evidence(payload)


AZ = DATA.parent / "azure"
HCL = (AZ / "hcl-report-tdx.bin").read_bytes()
AZ_QUOTE = (AZ / "quote.bin").read_bytes()
TPM_ATTEST = AZ_QUOTE[8 + 256 + 8 : 8 + 256 + 8 + 122]
ENVELOPE = AzureEvidence(REAL, HCL, TPM_ATTEST, bytes(256), {0: bytes(32)}).encode()


@FUZZ
@given(st.one_of(mutated(HCL), st.binary(max_size=3000)))
def test_hcl_report_parser(raw: bytes) -> None:
    with contextlib.suppress(QuoteParseError):
        parse_hcl_report(raw)


@FUZZ
@given(st.one_of(mutated(TPM_ATTEST), st.binary(max_size=300)))
def test_tpm_attest_parser(raw: bytes) -> None:
    with contextlib.suppress(QuoteParseError):
        parse_tpm_quote(raw)


@FUZZ
@given(st.one_of(mutated(ENVELOPE), st.binary(max_size=300)))
def test_azure_envelope_parser(raw: bytes) -> None:
    with contextlib.suppress(QuoteParseError):
        decode_envelope(raw)


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode), mutated(REAL)))
def test_evidence_input_decoder(raw: bytes) -> None:
    with contextlib.suppress(AttestError):
        decode_evidence(raw)
