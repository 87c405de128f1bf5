"""Azure TDX quote source: bind 64 bytes through the vTPM, fetch the TD quote from IMDS.

The hardware sits behind two small Protocols (`Vtpm`, `TdQuoteService`) so the source is tested
with the simulator and the real path is a thin shell around `tpm2-tools` and one HTTP call.
Nothing here has run on a real Azure CVM from this repository's CI (see the spec).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import shutil
import subprocess
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from umbra.attest.azure import (
    NV_HCL_REPORT,
    NV_USER_DATA,
    USER_DATA_LEN,
    AzureEvidence,
    parse_hcl_report,
    tpm_nonce_for,
)
from umbra.attest.errors import AttestError, QuoteSourceError

AZURE_AK_HANDLE = 0x81000003  # the persistent handle where Azure's vTPM keeps its AK
IMDS_TDQUOTE_URL = "http://169.254.169.254/acc/tdquote"
ALL_PCRS = tuple(range(24))
TPM_DEVICE = Path("/dev/tpmrm0")


class Vtpm(Protocol):
    def nv_write(self, index: int, data: bytes) -> None: ...

    def nv_read(self, index: int) -> bytes: ...

    def quote(self, nonce: bytes, pcrs: Sequence[int]) -> tuple[bytes, bytes, dict[int, bytes]]:
        """Return (TPMS_ATTEST, raw RSASSA signature, PCR values) for a SHA-256 PCR quote."""
        ...


class TdQuoteService(Protocol):
    def td_quote(self, td_report: bytes) -> bytes: ...


class AzureVtpmSource:
    """`QuoteSource` for Azure TDX CVMs: returns an Azure evidence envelope, not a bare quote."""

    simulated = False

    def __init__(self, vtpm: Vtpm | None = None, service: TdQuoteService | None = None) -> None:
        self.vtpm = vtpm if vtpm is not None else Tpm2ToolsVtpm()
        self.service = service if service is not None else ImdsTdQuote()
        self._lock = threading.Lock()  # NV write → read must not interleave with another binding

    def get_quote(self, report_data: bytes) -> bytes:
        if len(report_data) != USER_DATA_LEN:
            raise QuoteSourceError(f"report_data must be 64 bytes, got {len(report_data)}")
        with self._lock:
            self.vtpm.nv_write(NV_USER_DATA, report_data)
            raw_hcl = self.vtpm.nv_read(NV_HCL_REPORT)
        try:
            hcl = parse_hcl_report(raw_hcl)
        except AttestError as exc:
            raise QuoteSourceError(f"the vTPM's HCL report does not parse: {exc}") from None
        if hcl.runtime_data.user_data != report_data:
            raise QuoteSourceError("the HCL report does not carry the user data just written")
        td_quote = self.service.td_quote(hcl.td_report_raw)
        attest, signature, pcrs = self.vtpm.quote(tpm_nonce_for(report_data), ALL_PCRS)
        return AzureEvidence(td_quote, raw_hcl, attest, signature, pcrs).encode()


class Tpm2ToolsVtpm:
    """The vTPM through `tpm2-tools`: the kernel's resource manager (/dev/tpmrm0) by default, or
    any TCTI (tests use swtpm's)."""

    def __init__(
        self,
        device: Path = TPM_DEVICE,
        ak_handle: int = AZURE_AK_HANDLE,
        *,
        tcti: str | None = None,
    ) -> None:
        self.device = device
        self.ak_handle = ak_handle
        self.tcti = tcti if tcti is not None else f"device:{device}"

    def _run(self, *args: str) -> None:
        if self.tcti.startswith("device:") and not self.device.exists():
            raise QuoteSourceError(
                f"no vTPM at {self.device}: not an Azure confidential VM, or the TPM driver "
                "is not loaded"
            )
        if shutil.which(args[0]) is None:
            raise QuoteSourceError(f"{args[0]} not found: install tpm2-tools")
        env = {**os.environ, "TPM2TOOLS_TCTI": self.tcti}
        try:
            subprocess.run(args, check=True, capture_output=True, env=env, timeout=30)
        except subprocess.CalledProcessError as exc:
            err = exc.stderr.decode(errors="replace").strip().splitlines()
            raise QuoteSourceError(
                f"{args[0]} failed: {err[-1] if err else exc.returncode}"
            ) from None
        except subprocess.TimeoutExpired:
            raise QuoteSourceError(f"{args[0]} timed out") from None

    def nv_write(self, index: int, data: bytes) -> None:
        with tempfile.TemporaryDirectory(prefix="umbra-vtpm-") as tmp:
            path = Path(tmp) / "data"
            path.write_bytes(data)
            try:
                self._run("tpm2_nvreadpublic", hex(index))
            except QuoteSourceError:
                self._run("tpm2_nvdefine", "-C", "o", "-s", str(len(data)), hex(index))
            self._run("tpm2_nvwrite", "-C", "o", "-i", str(path), hex(index))

    def nv_read(self, index: int) -> bytes:
        with tempfile.TemporaryDirectory(prefix="umbra-vtpm-") as tmp:
            path = Path(tmp) / "data"
            self._run("tpm2_nvread", "-C", "o", "-o", str(path), hex(index))
            return path.read_bytes()

    def quote(self, nonce: bytes, pcrs: Sequence[int]) -> tuple[bytes, bytes, dict[int, bytes]]:
        with tempfile.TemporaryDirectory(prefix="umbra-vtpm-") as tmp:
            t = Path(tmp)
            self._run(
                "tpm2_quote",
                "-c", hex(self.ak_handle),
                "-l", "sha256:" + ",".join(str(i) for i in pcrs),
                "-q", nonce.hex(),
                "-g", "sha256",
                "-m", str(t / "msg"),
                "-s", str(t / "sig"),
                "-f", "plain",
                "-o", str(t / "pcrs"),
                "-F", "values",
            )  # fmt: skip
            values = (t / "pcrs").read_bytes()
            if len(values) != 32 * len(pcrs):
                raise QuoteSourceError("tpm2_quote returned the wrong number of PCR values")
            by_index = {p: values[32 * k : 32 * k + 32] for k, p in enumerate(sorted(pcrs))}
            return (t / "msg").read_bytes(), (t / "sig").read_bytes(), by_index


class ImdsTdQuote:
    """Azure IMDS turns a TD report into a TD quote (`POST /acc/tdquote`, base64url JSON)."""

    def __init__(self, url: str = IMDS_TDQUOTE_URL, timeout: float = 10.0) -> None:
        self.url = url
        self.timeout = timeout

    def td_quote(self, td_report: bytes) -> bytes:
        body = json.dumps({"report": base64.urlsafe_b64encode(td_report).decode().rstrip("=")})
        req = urllib.request.Request(  # noqa: S310 (the URL is IMDS's, fixed by configuration)
            self.url, data=body.encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310
                doc = json.loads(resp.read(1 << 20))
            text = str(doc["quote"])
            return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (urllib.error.URLError, OSError) as exc:
            raise QuoteSourceError(
                f"Azure IMDS quote endpoint {self.url} unreachable: {exc}"
            ) from None
        except (ValueError, KeyError, TypeError, binascii.Error, RecursionError):
            raise QuoteSourceError("Azure IMDS returned no quote") from None
