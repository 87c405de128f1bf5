"""`Tpm2ToolsVtpm` against a real software TPM (swtpm) through real tpm2-tools: NV write/read
and a PCR quote whose TPMS_ATTEST, signature and PCR values our verifier then checks."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from umbra.attest.azure import NV_USER_DATA
from umbra.attest.azure_source import ALL_PCRS, AZURE_AK_HANDLE, Tpm2ToolsVtpm
from umbra.attest.errors import QuoteSourceError
from umbra.attest.tpm import verify_tpm_quote

TOOLS = ("swtpm", "tpm2_quote", "tpm2_createprimary")
pytestmark = pytest.mark.skipif(
    any(shutil.which(t) is None for t in TOOLS),
    reason="LOUD SKIP: swtpm / tpm2-tools not installed (scripts/system-deps installs them)",
)


def _free_port_pair() -> int:
    """A port p with p+1 also free: swtpm's TCTI finds the control channel at p+1."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports on loopback")


def _tpm2(tcti: str, *args: str) -> None:
    env = {**os.environ, "TPM2TOOLS_TCTI": tcti}
    done = subprocess.run(args, capture_output=True, env=env, timeout=30)
    assert done.returncode == 0, f"{args[0]}: {done.stderr.decode(errors='replace')}"


@pytest.fixture
def swtpm() -> Iterator[tuple[str, Path]]:
    """A fresh swtpm with an RSA signing AK persisted at Azure's handle; yields (TCTI, AK PEM)."""
    state = Path(tempfile.mkdtemp(prefix=f"uat-swtpm-{os.getpid()}-"))
    port = _free_port_pair()
    proc = subprocess.Popen(
        [
            "swtpm", "socket", "--tpm2", "--tpmstate", f"dir={state}",
            "--server", f"type=tcp,port={port},bindaddr=127.0.0.1",
            "--ctrl", f"type=tcp,port={port + 1},bindaddr=127.0.0.1",
            "--flags", "not-need-init,startup-clear",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    tcti = f"swtpm:host=127.0.0.1,port={port}"
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        s = str(state)
        _tpm2(tcti, "tpm2_createprimary", "-Q", "-C", "o", "-c", f"{s}/p.ctx")
        _tpm2(tcti, "tpm2_flushcontext", "-t")
        _tpm2(
            tcti, "tpm2_create", "-Q", "-C", f"{s}/p.ctx", "-G", "rsa2048:rsassa-sha256:null",
            "-a", "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|restricted|sign",
            "-u", f"{s}/ak.pub", "-r", f"{s}/ak.priv",
        )  # fmt: skip
        _tpm2(tcti, "tpm2_flushcontext", "-t")
        _tpm2(
            tcti, "tpm2_load", "-Q", "-C", f"{s}/p.ctx", "-u", f"{s}/ak.pub",
            "-r", f"{s}/ak.priv", "-c", f"{s}/ak.ctx",
        )  # fmt: skip
        _tpm2(tcti, "tpm2_evictcontrol", "-Q", "-C", "o", "-c", f"{s}/ak.ctx", hex(AZURE_AK_HANDLE))
        _tpm2(tcti, "tpm2_flushcontext", "-t")
        pem = state / "ak.pem"
        _tpm2(
            tcti, "tpm2_readpublic", "-Q", "-c", hex(AZURE_AK_HANDLE), "-f", "pem", "-o", str(pem)
        )
        yield tcti, pem
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(state, ignore_errors=True)


def test_real_tpm_quote_verifies(swtpm: tuple[str, Path]) -> None:
    tcti, pem = swtpm
    vtpm = Tpm2ToolsVtpm(tcti=tcti)
    binding = bytes(range(64))
    vtpm.nv_write(NV_USER_DATA, binding)
    vtpm.nv_write(NV_USER_DATA, binding[::-1])  # the index exists now: written again, not defined
    assert vtpm.nv_read(NV_USER_DATA) == binding[::-1]
    nonce = os.urandom(32)
    attest, signature, pcrs = vtpm.quote(nonce, ALL_PCRS)
    assert sorted(pcrs) == list(range(24))
    ak = load_pem_public_key(pem.read_bytes())
    assert isinstance(ak, rsa.RSAPublicKey)
    quote, reasons = verify_tpm_quote(attest, signature, pcrs, ak, nonce)
    assert reasons == []
    assert quote is not None and quote.extra_data == nonce
    _, reasons = verify_tpm_quote(attest, signature, pcrs, ak, os.urandom(32))
    assert reasons == ["vTPM quote nonce does not match the expected value (stale or replayed?)"]


def test_tool_errors_are_one_line(swtpm: tuple[str, Path]) -> None:
    tcti, _ = swtpm
    with pytest.raises(QuoteSourceError, match="tpm2_nvread failed"):
        Tpm2ToolsVtpm(tcti=tcti).nv_read(0x01400001)  # no HCL report on a plain TPM
