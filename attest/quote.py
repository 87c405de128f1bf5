"""Strict parser for Intel TDX DCAP quotes: v4 and v5, TD report 1.0 and 1.5.

Stricter than dcap-qvl on purpose: every length must add up exactly, trailing bytes may only be
zero padding, and the embedded PEM chain must be canonical. Bytes that no signature covers
(lengths, padding, PEM framing) therefore cannot be changed without the quote being refused.
"""

from __future__ import annotations

import functools
import struct
import warnings
from dataclasses import dataclass
from enum import StrEnum

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from umbra.attest.errors import AttestError, QuoteParseError

TEE_TYPE_TDX = 0x81
ATT_KEY_ECDSA_P256 = 2
CERT_TYPE_PCK_CHAIN = 5
CERT_TYPE_QE_REPORT = 6
BODY_TYPE_TD10 = 2
BODY_TYPE_TD15 = 3

HEADER_LEN = 48
TD10_LEN = 584
TD15_LEN = 648
QE_REPORT_LEN = 384
# Far above any real quote (~5 KB) but small enough that a hostile length cannot cost memory.
MAX_QUOTE_LEN = 64 * 1024

# TDATTRIBUTES bit 0 (TUD.DEBUG): the host can read and write the TD's memory and registers.
TD_ATTR_DEBUG = 1 << 0


class TdReportVersion(StrEnum):
    TD10 = "1.0"
    TD15 = "1.5"


@dataclass(frozen=True)
class QuoteHeader:
    version: int
    attestation_key_type: int
    tee_type: int
    qe_svn: int
    pce_svn: int
    qe_vendor_id: bytes
    user_data: bytes


@dataclass(frozen=True)
class TdReport:
    version: TdReportVersion
    tee_tcb_svn: bytes
    mr_seam: bytes
    mr_signer_seam: bytes
    seam_attributes: bytes
    td_attributes: bytes
    xfam: bytes
    mr_td: bytes
    mr_config_id: bytes
    mr_owner: bytes
    mr_owner_config: bytes
    rtmrs: tuple[bytes, bytes, bytes, bytes]
    report_data: bytes
    tee_tcb_svn2: bytes | None = None
    mr_service_td: bytes | None = None

    @property
    def td_attributes_int(self) -> int:
        return int.from_bytes(self.td_attributes, "little")

    @property
    def xfam_int(self) -> int:
        return int.from_bytes(self.xfam, "little")

    @property
    def debug(self) -> bool:
        return bool(self.td_attributes_int & TD_ATTR_DEBUG)


@dataclass(frozen=True)
class QeReport:
    """The SGX report of the Quoting Enclave, signed by the PCK key."""

    raw: bytes
    cpu_svn: bytes
    misc_select: int
    attributes: bytes
    mr_enclave: bytes
    mr_signer: bytes
    isv_prod_id: int
    isv_svn: int
    report_data: bytes


@dataclass(frozen=True)
class Quote:
    raw: bytes
    header: QuoteHeader
    body_type: int
    td_report: TdReport
    signed_region: bytes  # header ‖ body as covered by the attestation-key signature
    signature: bytes  # raw r ‖ s, P-256
    attestation_key: bytes  # raw x ‖ y, P-256
    qe_report: QeReport
    qe_report_signature: bytes
    qe_auth_data: bytes
    pck_chain_pem: bytes
    padding: int  # trailing zero bytes after the signature data
    pck_root_der: bytes = b""  # the chain's last certificate, DER: read once, while parsing

    @property
    def pck_chain(self) -> list[x509.Certificate]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # hostile input may trip deprecation warnings
            return x509.load_pem_x509_certificates(self.pck_chain_pem.rstrip(b"\0"))


class _Reader:
    def __init__(self, data: bytes, start: int = 0, end: int | None = None) -> None:
        self.data = data
        self.pos = start
        self.end = len(data) if end is None else min(end, len(data))

    def take(self, n: int, field: str) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise QuoteParseError(
                f"truncated: need {n} bytes, {self.end - self.pos} left",
                field=field,
                offset=self.pos,
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u16(self, field: str) -> int:
        return int(struct.unpack("<H", self.take(2, field))[0])

    def u32(self, field: str) -> int:
        return int(struct.unpack("<I", self.take(4, field))[0])

    def expect_end(self, field: str) -> None:
        if self.pos != self.end:
            raise QuoteParseError(
                f"{self.end - self.pos} unexpected bytes after the structure",
                field=field,
                offset=self.pos,
            )


def parse_quote(raw: bytes) -> Quote:
    """Parse a TDX quote; raise `QuoteParseError` naming the field and offset on any defect."""
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise QuoteParseError("quote must be bytes", field="quote", offset=0)
    raw = bytes(raw)
    if len(raw) > MAX_QUOTE_LEN:
        raise QuoteParseError(
            f"quote is {len(raw)} bytes, larger than the {MAX_QUOTE_LEN} allowed",
            field="quote",
            offset=0,
        )
    r = _Reader(raw)
    header = _parse_header(r)
    if header.version == 4:
        body_type = BODY_TYPE_TD10
        body_len = TD10_LEN
    else:
        body_type = r.u16("body.type")
        body_len = r.u32("body.size")
        expected = {BODY_TYPE_TD10: TD10_LEN, BODY_TYPE_TD15: TD15_LEN}.get(body_type)
        if expected is None:
            raise QuoteParseError(
                f"unsupported v5 body type {body_type} (TDX needs 2 = TD 1.0 or 3 = TD 1.5)",
                field="body.type",
                offset=r.pos - 6,
            )
        if body_len != expected:
            raise QuoteParseError(
                f"body size {body_len} does not match body type {body_type} ({expected})",
                field="body.size",
                offset=r.pos - 4,
            )
    body_start = r.pos
    td = _parse_td_report(_Reader(raw, body_start, body_start + body_len), body_type)
    r.take(body_len, "body")
    signed_region = raw[: r.pos]

    sig_len = r.u32("signature_data.size")
    sig_start = r.pos
    if sig_start + sig_len > len(raw):
        raise QuoteParseError(
            f"signature data claims {sig_len} bytes, only {len(raw) - sig_start} present",
            field="signature_data.size",
            offset=sig_start - 4,
        )
    s = _Reader(raw, sig_start, sig_start + sig_len)
    signature = s.take(64, "signature_data.signature")
    att_key = s.take(64, "signature_data.attestation_key")
    cert_type = s.u16("certification_data.type")
    if cert_type != CERT_TYPE_QE_REPORT:
        raise QuoteParseError(
            f"certification data type {cert_type}, expected {CERT_TYPE_QE_REPORT} (QE report)",
            field="certification_data.type",
            offset=s.pos - 2,
        )
    cert_size = s.u32("certification_data.size")
    if cert_size != s.end - s.pos:
        raise QuoteParseError(
            f"certification data size {cert_size} != {s.end - s.pos} bytes remaining",
            field="certification_data.size",
            offset=s.pos - 4,
        )
    qe_raw = s.take(QE_REPORT_LEN, "qe_report")
    qe_sig = s.take(64, "qe_report_signature")
    auth_len = s.u16("qe_auth_data.size")
    auth = s.take(auth_len, "qe_auth_data")
    inner_type = s.u16("pck_cert_data.type")
    if inner_type != CERT_TYPE_PCK_CHAIN:
        raise QuoteParseError(
            f"inner certification data type {inner_type}, expected {CERT_TYPE_PCK_CHAIN} "
            "(PCK certificate chain)",
            field="pck_cert_data.type",
            offset=s.pos - 2,
        )
    chain_len = s.u32("pck_cert_data.size")
    if chain_len != s.end - s.pos:
        raise QuoteParseError(
            f"PCK chain size {chain_len} != {s.end - s.pos} bytes remaining",
            field="pck_cert_data.size",
            offset=s.pos - 4,
        )
    chain_off = s.pos
    chain = s.take(chain_len, "pck_cert_data.chain")
    s.expect_end("signature_data")
    root_der = _check_chain(chain, chain_off)
    r.take(sig_len, "signature_data")
    padding = raw[r.pos :]
    if padding.strip(b"\x00"):
        bad = r.pos + next(i for i, b in enumerate(padding) if b)
        raise QuoteParseError(
            "non-zero bytes after the signature data", field="trailing_padding", offset=bad
        )
    return Quote(
        raw=raw,
        header=header,
        body_type=body_type,
        td_report=td,
        signed_region=signed_region,
        signature=signature,
        attestation_key=att_key,
        qe_report=_parse_qe_report(qe_raw),
        qe_report_signature=qe_sig,
        qe_auth_data=auth,
        pck_chain_pem=chain,
        padding=len(padding),
        pck_root_der=root_der,
    )


def _parse_header(r: _Reader) -> QuoteHeader:
    version = r.u16("header.version")
    if version not in (4, 5):
        raise QuoteParseError(
            f"unsupported quote version {version} (4 or 5)", field="header.version", offset=0
        )
    key_type = r.u16("header.attestation_key_type")
    if key_type != ATT_KEY_ECDSA_P256:
        raise QuoteParseError(
            f"attestation key type {key_type}, expected {ATT_KEY_ECDSA_P256} (ECDSA P-256)",
            field="header.attestation_key_type",
            offset=2,
        )
    tee_type = r.u32("header.tee_type")
    if tee_type != TEE_TYPE_TDX:
        raise QuoteParseError(
            f"TEE type {tee_type:#x} is not TDX ({TEE_TYPE_TDX:#x})",
            field="header.tee_type",
            offset=4,
        )
    qe_svn = r.u16("header.qe_svn")
    pce_svn = r.u16("header.pce_svn")
    vendor = r.take(16, "header.qe_vendor_id")
    user_data = r.take(20, "header.user_data")
    return QuoteHeader(version, key_type, tee_type, qe_svn, pce_svn, vendor, user_data)


def _parse_td_report(r: _Reader, body_type: int) -> TdReport:
    f = r.take
    tee_tcb_svn = f(16, "td_report.tee_tcb_svn")
    mr_seam = f(48, "td_report.mr_seam")
    mr_signer_seam = f(48, "td_report.mr_signer_seam")
    seam_attributes = f(8, "td_report.seam_attributes")
    td_attributes = f(8, "td_report.td_attributes")
    xfam = f(8, "td_report.xfam")
    mr_td = f(48, "td_report.mr_td")
    mr_config_id = f(48, "td_report.mr_config_id")
    mr_owner = f(48, "td_report.mr_owner")
    mr_owner_config = f(48, "td_report.mr_owner_config")
    rtmrs = (
        f(48, "td_report.rtmr0"),
        f(48, "td_report.rtmr1"),
        f(48, "td_report.rtmr2"),
        f(48, "td_report.rtmr3"),
    )
    report_data = f(64, "td_report.report_data")
    svn2 = service = None
    version = TdReportVersion.TD10
    if body_type == BODY_TYPE_TD15:
        version = TdReportVersion.TD15
        svn2 = f(16, "td_report.tee_tcb_svn2")
        service = f(48, "td_report.mr_service_td")
    r.expect_end("td_report")
    return TdReport(
        version,
        tee_tcb_svn,
        mr_seam,
        mr_signer_seam,
        seam_attributes,
        td_attributes,
        xfam,
        mr_td,
        mr_config_id,
        mr_owner,
        mr_owner_config,
        rtmrs,
        report_data,
        svn2,
        service,
    )


def _parse_qe_report(raw: bytes) -> QeReport:
    r = _Reader(raw)
    cpu_svn = r.take(16, "qe_report.cpu_svn")
    misc = r.u32("qe_report.misc_select")
    r.take(28, "qe_report.reserved1")
    attributes = r.take(16, "qe_report.attributes")
    mr_enclave = r.take(32, "qe_report.mr_enclave")
    r.take(32, "qe_report.reserved2")
    mr_signer = r.take(32, "qe_report.mr_signer")
    r.take(96, "qe_report.reserved3")
    prod = r.u16("qe_report.isv_prod_id")
    svn = r.u16("qe_report.isv_svn")
    r.take(60, "qe_report.reserved4")
    report_data = r.take(64, "qe_report.report_data")
    return QeReport(raw, cpu_svn, misc, attributes, mr_enclave, mr_signer, prod, svn, report_data)


def _check_chain(chain: bytes, offset: int) -> bytes:
    """Demand a canonical PEM chain (one optional NUL terminator, as Intel's QE writes); return
    the DER of its last certificate (the root the verifier compares with its anchor).

    A lenient PEM reader ignores whitespace and the spare bits of the last base64 group, so
    without this check some bit flips in the chain would leave the quote valid.
    """
    body = chain[:-1] if chain.endswith(b"\x00") else chain
    try:
        return _canonical_chain_root(body)
    except _ChainError as exc:
        raise QuoteParseError(str(exc), field="pck_cert_data.chain", offset=offset) from None


class _ChainError(AttestError):
    pass


@functools.lru_cache(maxsize=64)
def _canonical_chain_root(body: bytes) -> bytes:
    """A pure function of the chain's exact bytes, so kept per chain: every quote from one
    platform carries the same chain, and reading it is a fifth of a verification. Only
    accepted chains are kept (an exception is never cached)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # hostile input may trip deprecation warnings
            certs = x509.load_pem_x509_certificates(body)
        canonical = b"".join(c.public_bytes(Encoding.PEM) for c in certs)
        root_der = certs[-1].public_bytes(Encoding.DER) if certs else b""
    except (ValueError, TypeError, x509.InvalidVersion) as exc:
        raise _ChainError(f"PCK certificate chain is not valid PEM: {exc}") from None
    if canonical != body:
        raise _ChainError("PCK certificate chain is not canonical PEM")
    if len(certs) < 2:
        raise _ChainError(
            f"PCK certificate chain has {len(certs)} certificate(s), expected at least 2"
        )
    return root_der
