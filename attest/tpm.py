"""TPM 2.0 quotes as a vTPM produces them: `TPMS_ATTEST` parsing, AK signature, PCR digest.

A quote is the TPM's signature over a `TPMS_ATTEST` (magic TPM_GENERATED_VALUE, type
TPM_ST_ATTEST_QUOTE) whose `extraData` is the verifier's nonce and whose `TPMS_QUOTE_INFO` holds a
PCR selection and the digest of the selected PCR values, concatenated in selection order. The PCR
values travel unsigned beside the quote, so they are trusted only once their digest matches.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from umbra.attest.errors import QuoteParseError

TPM_GENERATED_VALUE = 0xFF544347
TPM_ST_ATTEST_QUOTE = 0x8018
TPM_ALG_SHA256 = 0x000B
PCR_COUNT = 24
MAX_ATTEST_LEN = 4096


@dataclass(frozen=True)
class TpmQuote:
    """A parsed `TPMS_ATTEST` of type quote, restricted to one SHA-256 PCR bank."""

    qualified_signer: bytes
    extra_data: bytes
    clock: int
    reset_count: int
    restart_count: int
    safe: bool
    firmware_version: int
    pcr_indices: tuple[int, ...]
    pcr_digest: bytes


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.off = 0

    def take(self, n: int, field: str) -> bytes:
        if self.off + n > len(self.data):
            raise QuoteParseError("TPMS_ATTEST is truncated", field=field, offset=self.off)
        out = self.data[self.off : self.off + n]
        self.off += n
        return out

    def u(self, fmt: str, field: str) -> int:
        (v,) = struct.unpack(">" + fmt, self.take(struct.calcsize(fmt), field))
        return int(v)

    def sized(self, field: str) -> bytes:
        return self.take(self.u("H", field), field)


def parse_tpm_quote(attest: bytes) -> TpmQuote:
    """Parse a `TPMS_ATTEST`; every byte must be accounted for (no trailing data)."""
    if len(attest) > MAX_ATTEST_LEN:
        raise QuoteParseError(
            f"TPMS_ATTEST of {len(attest)} bytes is too long", field="attest", offset=0
        )
    r = _Reader(attest)
    if r.u("I", "magic") != TPM_GENERATED_VALUE:
        raise QuoteParseError("not a TPM-generated structure (magic)", field="magic", offset=0)
    if r.u("H", "type") != TPM_ST_ATTEST_QUOTE:
        raise QuoteParseError("TPMS_ATTEST is not a quote", field="type", offset=4)
    signer = r.sized("qualifiedSigner")
    extra = r.sized("extraData")
    clock = r.u("Q", "clock")
    resets = r.u("I", "resetCount")
    restarts = r.u("I", "restartCount")
    safe = r.u("B", "safe")
    firmware = r.u("Q", "firmwareVersion")
    count = r.u("I", "pcrSelect.count")
    if count != 1:
        raise QuoteParseError(
            f"quote selects {count} PCR banks; exactly one (SHA-256) is accepted",
            field="pcrSelect.count",
            offset=r.off - 4,
        )
    if r.u("H", "pcrSelect.hash") != TPM_ALG_SHA256:
        raise QuoteParseError("PCR bank is not SHA-256", field="pcrSelect.hash", offset=r.off - 2)
    size = r.u("B", "pcrSelect.sizeofSelect")
    if not 1 <= size <= 4:
        raise QuoteParseError("bad PCR select size", field="pcrSelect.sizeofSelect", offset=r.off)
    bitmap = r.take(size, "pcrSelect.pcrSelect")
    indices = tuple(i for i in range(8 * size) if bitmap[i // 8] >> (i % 8) & 1)
    if any(i >= PCR_COUNT for i in indices):
        raise QuoteParseError("PCR index out of range", field="pcrSelect", offset=r.off)
    digest = r.sized("pcrDigest")
    if len(digest) != 32:
        raise QuoteParseError("PCR digest is not 32 bytes", field="pcrDigest", offset=r.off)
    if r.off != len(attest):
        raise QuoteParseError("trailing bytes after TPMS_ATTEST", field="attest", offset=r.off)
    return TpmQuote(signer, extra, clock, resets, restarts, safe == 1, firmware, indices, digest)


def verify_tpm_quote(
    attest: bytes,
    signature: bytes,
    pcr_values: dict[int, bytes],
    ak: rsa.RSAPublicKey,
    expected_nonce: bytes | None,
) -> tuple[TpmQuote | None, list[str]]:
    """Check the AK signature (RSASSA-PKCS1-v1_5, SHA-256), the nonce, and the PCR digest.

    Returns the parsed quote (None if it does not parse) and the reasons it is refused; the PCR
    values are trustworthy only when the reasons are empty.
    """
    try:
        quote = parse_tpm_quote(attest)
    except QuoteParseError as exc:
        return None, [f"vTPM quote is malformed: {exc}"]
    reasons: list[str] = []
    try:
        ak.verify(signature, attest, padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        reasons.append("vTPM quote signature does not verify with the attestation key")
    if expected_nonce is not None and not hmac.compare_digest(quote.extra_data, expected_nonce):
        reasons.append("vTPM quote nonce does not match the expected value (stale or replayed?)")
    if set(pcr_values) != set(quote.pcr_indices):
        reasons.append(
            "PCR values supplied for "
            + ",".join(str(i) for i in sorted(pcr_values))
            + " but the quote selects "
            + ",".join(str(i) for i in quote.pcr_indices)
        )
    elif any(len(v) != 32 for v in pcr_values.values()):
        reasons.append("a PCR value is not 32 bytes")
    else:
        joined = b"".join(pcr_values[i] for i in quote.pcr_indices)
        if not hmac.compare_digest(hashlib.sha256(joined).digest(), quote.pcr_digest):
            reasons.append("PCR values do not match the digest the vTPM signed")
    return quote, reasons


def build_tpm_quote(nonce: bytes, pcr_values: dict[int, bytes], signer: bytes = b"") -> bytes:
    """Serialise a `TPMS_ATTEST` quote (simulator and tests): the inverse of `parse_tpm_quote`."""
    indices = sorted(pcr_values)
    bitmap = bytearray(3)
    for i in indices:
        bitmap[i // 8] |= 1 << (i % 8)
    digest = hashlib.sha256(b"".join(pcr_values[i] for i in indices)).digest()
    return (
        struct.pack(">IH", TPM_GENERATED_VALUE, TPM_ST_ATTEST_QUOTE)
        + struct.pack(">H", len(signer))
        + signer
        + struct.pack(">H", len(nonce))
        + nonce
        + struct.pack(">QIIBQ", 0, 1, 0, 1, 0)
        + struct.pack(">IHB", 1, TPM_ALG_SHA256, 3)
        + bytes(bitmap)
        + struct.pack(">H", 32)
        + digest
    )
