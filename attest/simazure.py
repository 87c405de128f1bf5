"""A simulated Azure TDX CVM: paravisor, vTPM and IMDS quote service in one stand-in.

It implements the `Vtpm` and `TdQuoteService` seams, so `AzureVtpmSource` runs unchanged on it,
and its TD quotes are signed by the simulated PKI (verifiers accept them only when told to).
RTMRs are zero, as under the real paravisor; boot measurements are in PCRs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from umbra.attest.azure import (
    NV_HCL_REPORT,
    NV_USER_DATA,
    TdReportFields,
    build_hcl_report,
    build_td_report,
    parse_td_report,
)
from umbra.attest.azure_source import AzureVtpmSource
from umbra.attest.errors import AttestError, QuoteSourceError
from umbra.attest.measurement import ReleaseManifest
from umbra.attest.quote import parse_quote
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx, simulated_boot_values
from umbra.attest.tpm import build_tpm_quote


def simulated_pcrs(image: str) -> dict[int, bytes]:
    """Deterministic stand-ins for an image's boot PCRs (0-7 and 11)."""
    return {
        i: hashlib.sha256(f"umbra-simulated-pcr:{i}:{image}".encode()).digest()
        for i in (*range(8), 11)
    }


def _b64url(n: int) -> str:
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@dataclass
class SimulatedAzureCvm:
    pki: SimulatedPki
    image: str = "umbra-security-cvm"
    ak: rsa.RSAPrivateKey = field(
        default_factory=lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048)
    )
    user_data: bytes = bytes(64)
    pcrs: dict[int, bytes] = field(default_factory=dict)
    _tdx: SimulatedTdx | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.pcrs = self.pcrs or simulated_pcrs(self.image)
        self._tdx = SimulatedTdx(self.pki, image=self.image)
        self._tdx.events = []  # the guest cannot extend RTMRs under the paravisor: all zero
        full = dict.fromkeys(range(24), bytes(32))
        full.update(self.pcrs)
        self.pcrs = full

    @property
    def tdx(self) -> SimulatedTdx:
        assert self._tdx is not None
        return self._tdx

    def runtime_data(self) -> bytes:
        pub = self.ak.public_key().public_numbers()
        doc: dict[str, Any] = {
            "keys": [
                {"kid": "HCLAkPub", "key_ops": ["sign"], "kty": "RSA",
                 "e": _b64url(pub.e), "n": _b64url(pub.n)},
            ],
            "vm-configuration": {"secure-boot": True, "tpm-enabled": True},
            "user-data": self.user_data.hex(),
        }  # fmt: skip
        return json.dumps(doc, separators=(",", ":")).encode()

    def _td_report(self, report_data: bytes) -> bytes:
        td = parse_quote(self.tdx.quote(report_data)).td_report
        return build_td_report(
            TdReportFields(
                report_data=td.report_data,
                tee_tcb_svn=td.tee_tcb_svn,
                mr_seam=td.mr_seam,
                mr_signer_seam=td.mr_signer_seam,
                seam_attributes=td.seam_attributes,
                td_attributes=td.td_attributes,
                xfam=td.xfam,
                mr_td=td.mr_td,
                mr_config_id=td.mr_config_id,
                mr_owner=td.mr_owner,
                mr_owner_config=td.mr_owner_config,
                rtmrs=td.rtmrs,
            )
        )

    # Vtpm
    def nv_write(self, index: int, data: bytes) -> None:
        if index != NV_USER_DATA or len(data) != 64:
            raise QuoteSourceError(f"simulated vTPM: cannot write {len(data)} bytes to {index:#x}")
        with self._lock:
            self.user_data = data

    def nv_read(self, index: int) -> bytes:
        if index != NV_HCL_REPORT:
            raise QuoteSourceError(f"simulated vTPM: no NV index {index:#x}")
        with self._lock:
            runtime = self.runtime_data()
        rd = hashlib.sha256(runtime).digest() + bytes(32)
        return build_hcl_report(self._td_report(rd), runtime)

    def quote(self, nonce: bytes, pcrs: Sequence[int]) -> tuple[bytes, bytes, dict[int, bytes]]:
        values = {i: self.pcrs[i] for i in pcrs}
        attest = build_tpm_quote(nonce, values, signer=b"\x00\x0b" + bytes(32))
        sig = self.ak.sign(attest, padding.PKCS1v15(), hashes.SHA256())
        return attest, sig, values

    # TdQuoteService: like the real quoting service, it quotes only TD reports of this TD
    def td_quote(self, td_report: bytes) -> bytes:
        try:
            fields = parse_td_report(td_report)
        except AttestError as exc:
            raise QuoteSourceError(f"simulated IMDS: {exc}") from None
        return self.tdx.quote(fields.report_data)

    def source(self) -> AzureVtpmSource:
        src = AzureVtpmSource(self, self)
        src.simulated = True
        return src

    def release_manifest(self, name: str | None = None, **extra: object) -> ReleaseManifest:
        return ReleaseManifest.model_validate(
            {
                "apiVersion": "umbra/v1",
                "kind": "ReleaseManifest",
                "name": name or self.image,
                "tee": "simulated",
                "platform": "azure-tdx",
                "mrtd": simulated_boot_values(self.image)["mrtd"],
                "pcrs": {i: [v.hex()] for i, v in simulated_pcrs(self.image).items()},
                **extra,
            }
        )
