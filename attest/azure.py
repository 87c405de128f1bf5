"""Azure TDX evidence: the paravisor's HCL report, the vTPM quote, and the envelope carrying them.

Under Azure's paravisor the guest cannot choose REPORTDATA: the paravisor sets it to SHA-256 of
its runtime data (a JSON document holding the vTPM attestation key and the guest's 64 bytes of
`user-data`, written to vTPM NV index 0x01400002). The chain a verifier checks is therefore

    Intel PCK → TD quote (DCAP) → REPORTDATA[0:32] = SHA-256(runtime data)
      → runtime data's user-data = the binding the verifier expects
      → runtime data's AK → vTPM quote (fresh nonce) → PCR values → measurement policy.

The envelope is self-describing so every existing carrier of "a quote" (aTLS EVIDENCE, the
Console release, files on disk) carries Azure evidence unchanged: a bare TDX quote starts with
its u16 version (4 or 5); an envelope starts with `ENVELOPE_MAGIC`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric import rsa

from umbra.attest.errors import QuoteParseError

ENVELOPE_MAGIC = b"UMBRAAZ\x01"
MAX_ENVELOPE_LEN = 128 * 1024
NV_HCL_REPORT = 0x01400001
NV_USER_DATA = 0x01400002
USER_DATA_LEN = 64

HCL_MAGIC = b"HCLA"
HCL_HEADER_LEN = 32
HW_REPORT_LEN = 1184  # the hardware-report slot is sized for an SNP report; a TD report fills 1024
TD_REPORT_LEN = 1024
IGVM_DATA_HEADER_LEN = 20
IGVM_REPORT_TYPE_TDX = 4
IGVM_HASH_SHA256 = 1
TD_REPORT_TYPE_TDX = 0x81


@dataclass(frozen=True)
class TdReportFields:
    """The fields of a raw 1024-byte TD report that a TD quote body repeats."""

    report_data: bytes
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


def parse_td_report(raw: bytes) -> TdReportFields:
    """REPORTMACSTRUCT (256) ‖ TEE_TCB_INFO (239) ‖ reserved (17) ‖ TDINFO (512)."""
    if len(raw) != TD_REPORT_LEN:
        raise QuoteParseError(
            f"TD report is {len(raw)} bytes, not 1024", field="td_report", offset=0
        )
    if raw[0] != TD_REPORT_TYPE_TDX or raw[1] != 0 or raw[2] > 1 or any(raw[3:16]):
        raise QuoteParseError("report type is not TDX (0x81)", field="report_type", offset=0)
    # Nothing signs the HCL report's copy of the TD report; what a TD quote does not repeat must
    # at least be consistent, so that no byte of it can change unnoticed (CPUSVN and the MAC
    # are the exceptions: only the TDX module on that host can check the MAC).
    if hashlib.sha384(raw[256:495]).digest() != raw[32:80]:
        raise QuoteParseError("TEE_TCB_INFO_HASH does not match", field="tee_tcb_info", offset=256)
    if hashlib.sha384(raw[512:]).digest() != raw[80:128]:
        raise QuoteParseError("TEE_INFO_HASH does not match", field="td_info", offset=512)
    if any(raw[192:224]) or any(raw[495:512]):
        raise QuoteParseError("reserved bytes are not zero", field="reserved", offset=192)

    def at(off: int, n: int) -> bytes:
        return raw[off : off + n]

    td = 512
    return TdReportFields(
        report_data=at(128, 64),
        tee_tcb_svn=at(256 + 8, 16),
        mr_seam=at(256 + 24, 48),
        mr_signer_seam=at(256 + 72, 48),
        seam_attributes=at(256 + 120, 8),
        td_attributes=at(td, 8),
        xfam=at(td + 8, 8),
        mr_td=at(td + 16, 48),
        mr_config_id=at(td + 64, 48),
        mr_owner=at(td + 112, 48),
        mr_owner_config=at(td + 160, 48),
        rtmrs=(at(td + 208, 48), at(td + 256, 48), at(td + 304, 48), at(td + 352, 48)),
    )


def build_td_report(f: TdReportFields) -> bytes:
    """The inverse of `parse_td_report` (simulator and tests; MAC and hashes left zero)."""
    tcb = (
        bytes.fromhex("ff01030000000000")  # TEE_TCB_INFO.VALID as on a real TDX 1.5 module
        + f.tee_tcb_svn
        + f.mr_seam
        + f.mr_signer_seam
        + f.seam_attributes
        + bytes(111)
    )
    info = (
        f.td_attributes
        + f.xfam
        + f.mr_td
        + f.mr_config_id
        + f.mr_owner
        + f.mr_owner_config
        + b"".join(f.rtmrs)
        + bytes(48 + 64)
    )
    mac = (
        bytes([TD_REPORT_TYPE_TDX, 0, 0, 0])
        + bytes(28)
        + hashlib.sha384(tcb).digest()
        + hashlib.sha384(info).digest()
        + f.report_data
        + bytes(64)
    )
    return mac + tcb + bytes(17) + info


@dataclass(frozen=True)
class RuntimeData:
    """The paravisor's runtime-data JSON: the vTPM AK and the guest's user data."""

    raw: bytes
    ak: rsa.RSAPublicKey
    user_data: bytes | None
    vm_configuration: dict[str, Any]


def _b64url_int(value: object, what: str) -> int:
    if not isinstance(value, str):
        raise QuoteParseError(f"{what} is not a string", field=what, offset=0)
    try:
        return int.from_bytes(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)), "big")
    except (binascii.Error, ValueError):
        raise QuoteParseError(f"{what} is not base64url", field=what, offset=0) from None


def parse_runtime_data(raw: bytes) -> RuntimeData:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # deep nesting is hostile input
        raise QuoteParseError("runtime data is not JSON", field="runtime_data", offset=0) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise QuoteParseError("runtime data has no key list", field="keys", offset=0)
    aks = [k for k in doc["keys"] if isinstance(k, dict) and k.get("kid") == "HCLAkPub"]
    if len(aks) != 1:
        raise QuoteParseError(
            f"runtime data holds {len(aks)} HCLAkPub keys, expected one", field="keys", offset=0
        )
    jwk = aks[0]
    if jwk.get("kty") != "RSA":
        raise QuoteParseError("HCLAkPub is not an RSA key", field="HCLAkPub.kty", offset=0)
    n = _b64url_int(jwk.get("n"), "HCLAkPub.n")
    e = _b64url_int(jwk.get("e"), "HCLAkPub.e")
    if n.bit_length() < 2048 or e < 3:
        raise QuoteParseError("HCLAkPub is weaker than RSA-2048", field="HCLAkPub.n", offset=0)
    try:
        ak = rsa.RSAPublicNumbers(e, n).public_key()
    except ValueError:  # e.g. an even exponent: not a key, whatever its size
        raise QuoteParseError(
            "HCLAkPub is not a valid RSA key", field="HCLAkPub", offset=0
        ) from None
    user_data: bytes | None = None
    if "user-data" in doc:
        try:
            user_data = bytes.fromhex(str(doc["user-data"]))
        except ValueError:
            raise QuoteParseError("user-data is not hex", field="user-data", offset=0) from None
    vm = doc.get("vm-configuration")
    return RuntimeData(raw, ak, user_data, vm if isinstance(vm, dict) else {})


@dataclass(frozen=True)
class HclReport:
    raw: bytes
    version: int
    td_report_raw: bytes
    td_report: TdReportFields
    runtime_data: RuntimeData


def parse_hcl_report(raw: bytes) -> HclReport:
    """HCL header (32) ‖ hardware report (1184) ‖ IGVM request data (20) ‖ runtime data; the
    NV index is larger than the report, so trailing bytes must be zero."""
    fixed = HCL_HEADER_LEN + HW_REPORT_LEN + IGVM_DATA_HEADER_LEN
    if len(raw) < fixed:
        raise QuoteParseError(f"HCL report of {len(raw)} bytes is truncated", field="hcl", offset=0)
    if raw[:4] != HCL_MAGIC:
        raise QuoteParseError("not an HCL report (magic HCLA)", field="signature", offset=0)
    version, report_size, request_type, status = struct.unpack_from("<IIII", raw, 4)
    if version != 2 or request_type != 2 or status != 0 or any(raw[20:HCL_HEADER_LEN]):
        raise QuoteParseError(
            "unknown HCL header (version 2, request type 2, status 0 expected)",
            field="header",
            offset=4,
        )
    off = HCL_HEADER_LEN + HW_REPORT_LEN
    data_size, data_version, report_type, hash_type, var_size = struct.unpack_from("<5I", raw, off)
    if data_version != 1:
        raise QuoteParseError(
            f"IGVM request data version {data_version} is not 1",
            field="data_version",
            offset=off + 4,
        )
    if report_type != IGVM_REPORT_TYPE_TDX:
        raise QuoteParseError(
            f"HCL report type {report_type} is not TDX ({IGVM_REPORT_TYPE_TDX})",
            field="report_type",
            offset=off + 8,
        )
    if hash_type != IGVM_HASH_SHA256:
        raise QuoteParseError(
            "runtime data hash is not SHA-256", field="hash_type", offset=off + 12
        )
    end = fixed + var_size
    if data_size != IGVM_DATA_HEADER_LEN + var_size or report_size != end or end > len(raw):
        raise QuoteParseError("HCL report sizes do not add up", field="report_size", offset=4)
    if any(raw[end:]):
        raise QuoteParseError("non-zero bytes after the HCL report", field="padding", offset=end)
    hw = raw[HCL_HEADER_LEN:off]
    if any(hw[TD_REPORT_LEN:]):
        raise QuoteParseError(
            "non-zero bytes after the TD report", field="hw_report", offset=HCL_HEADER_LEN + 1024
        )
    td_raw = hw[:TD_REPORT_LEN]
    return HclReport(
        raw=raw,
        version=version,
        td_report_raw=td_raw,
        td_report=parse_td_report(td_raw),
        runtime_data=parse_runtime_data(raw[fixed:end]),
    )


def build_hcl_report(td_report: bytes, runtime_data: bytes, nv_size: int = 2600) -> bytes:
    """The inverse of `parse_hcl_report` (simulator and tests)."""
    size = HCL_HEADER_LEN + HW_REPORT_LEN + IGVM_DATA_HEADER_LEN + len(runtime_data)
    header = HCL_MAGIC + struct.pack("<IIII", 2, size, 2, 0) + bytes(12)
    data = struct.pack(
        "<5I",
        IGVM_DATA_HEADER_LEN + len(runtime_data),
        1,
        IGVM_REPORT_TYPE_TDX,
        IGVM_HASH_SHA256,
        len(runtime_data),
    )
    out = header + td_report.ljust(HW_REPORT_LEN, b"\0") + data + runtime_data
    return out.ljust(nv_size, b"\0")


def tpm_nonce_for(report_data: bytes) -> bytes:
    """The vTPM quote's nonce for one binding: fresh whenever the binding is (32 bytes fits
    every vTPM's TPM2B_DATA)."""
    return hashlib.sha256(b"umbra-azure-vtpm-nonce\0" + report_data).digest()


@dataclass(frozen=True)
class AzureEvidence:
    td_quote: bytes
    hcl_report: bytes
    tpm_attest: bytes
    tpm_signature: bytes
    pcrs: dict[int, bytes]

    def encode(self) -> bytes:
        pcrs = b"".join(bytes([i]) + v for i, v in sorted(self.pcrs.items()))
        parts = (self.td_quote, self.hcl_report, self.tpm_attest, self.tpm_signature, pcrs)
        return ENVELOPE_MAGIC + b"".join(struct.pack(">I", len(p)) + p for p in parts)


def is_azure_envelope(raw: bytes) -> bool:
    return raw.startswith(ENVELOPE_MAGIC)


def decode_envelope(raw: bytes) -> AzureEvidence:
    """Strict: five length-prefixed fields, nothing after them, PCRs unique and in order."""
    if len(raw) > MAX_ENVELOPE_LEN:
        raise QuoteParseError("Azure evidence is too large", field="envelope", offset=0)
    if not is_azure_envelope(raw):
        raise QuoteParseError("not an Azure evidence envelope", field="magic", offset=0)
    off = len(ENVELOPE_MAGIC)
    parts: list[bytes] = []
    for name in ("td_quote", "hcl_report", "tpm_attest", "tpm_signature", "pcrs"):
        if off + 4 > len(raw):
            raise QuoteParseError("Azure evidence is truncated", field=name, offset=off)
        (n,) = struct.unpack_from(">I", raw, off)
        if off + 4 + n > len(raw):
            raise QuoteParseError("Azure evidence is truncated", field=name, offset=off)
        parts.append(raw[off + 4 : off + 4 + n])
        off += 4 + n
    if off != len(raw):
        raise QuoteParseError("trailing bytes after Azure evidence", field="envelope", offset=off)
    blob = parts[4]
    if len(blob) % 33:
        raise QuoteParseError("PCR list is not whole entries", field="pcrs", offset=0)
    pcrs: dict[int, bytes] = {}
    last = -1
    for i in range(0, len(blob), 33):
        index = blob[i]
        if index <= last or index >= 24:
            raise QuoteParseError("PCR indices out of order or range", field="pcrs", offset=i)
        pcrs[index] = blob[i + 1 : i + 33]
        last = index
    return AzureEvidence(parts[0], parts[1], parts[2], parts[3], pcrs)
