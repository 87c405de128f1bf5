"""Azure TDX through the paravisor: the real vectors link by link, the whole chain on the
simulated CVM, and each way to break it."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from pydantic import ValidationError

from umbra.attest.azure import (
    AzureEvidence,
    decode_envelope,
    parse_hcl_report,
    tpm_nonce_for,
)
from umbra.attest.azure_source import AzureVtpmSource, Tpm2ToolsVtpm
from umbra.attest.collateral import Collateral, StaticCollateral
from umbra.attest.errors import QuoteParseError, QuoteSourceError
from umbra.attest.measurement import MeasurementPolicy, ReleaseManifest
from umbra.attest.simazure import SimulatedAzureCvm
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.tpm import parse_tpm_quote, verify_tpm_quote
from umbra.attest.verify import Step, Verdict, Verifier

from .conftest import T_SIM

AZ = Path(__file__).resolve().parent.parent / "data" / "azure"
BINDING = bytes(range(64))


def _vtpm_quote() -> tuple[bytes, bytes, dict[int, bytes]]:
    """quote.bin: u64-LE-length-prefixed signature, message, then a count of 32-byte PCRs."""
    raw = (AZ / "quote.bin").read_bytes()
    off = 0

    def field() -> bytes:
        nonlocal off
        (n,) = struct.unpack_from("<Q", raw, off)
        off += 8 + n
        return raw[off - n : off]

    sig, msg = field(), field()
    (count,) = struct.unpack_from("<Q", raw, off)
    off += 8
    pcrs = {i: raw[off + 32 * i : off + 32 * i + 32] for i in range(count)}
    assert off + 32 * count == len(raw)
    return msg, sig, pcrs


def _ak() -> rsa.RSAPublicKey:
    key = load_pem_public_key((AZ / "akpub.pem").read_bytes())
    assert isinstance(key, rsa.RSAPublicKey)
    return key


# --- the real vectors, link by link ---


def test_real_hcl_report_parses_and_binds_its_runtime_data() -> None:
    hcl = parse_hcl_report((AZ / "hcl-report-tdx.bin").read_bytes())
    td = hcl.td_report
    assert td.report_data[:32] == hashlib.sha256(hcl.runtime_data.raw).digest()
    assert td.report_data[32:] == bytes(32)
    assert all(r == bytes(48) for r in td.rtmrs)  # the paravisor leaves RTMRs zero
    assert hcl.runtime_data.user_data == bytes(64)  # nothing was bound on that VM
    assert hcl.runtime_data.ak.key_size == 2048
    assert hcl.runtime_data.vm_configuration["tpm-enabled"] is True


def test_real_hcl_report_tampering_is_refused_or_unbinds() -> None:
    raw = bytearray((AZ / "hcl-report-tdx.bin").read_bytes())
    hcl = parse_hcl_report(bytes(raw))
    start = len(raw) - len(raw.rstrip(b"\0"))
    body_end = len(raw) - start
    json_start = body_end - len(hcl.runtime_data.raw)
    raw[json_start + 100] ^= 0x01  # inside the AK's base64url
    try:
        bad = parse_hcl_report(bytes(raw))
    except QuoteParseError:
        return
    assert bad.td_report.report_data[:32] != hashlib.sha256(bad.runtime_data.raw).digest()


@pytest.mark.parametrize("where", [0, 4, 8, 1216 + 4, 1216 + 8, 1216 + 12, 2599])
def test_real_hcl_report_structure_is_strict(where: int) -> None:
    raw = bytearray((AZ / "hcl-report-tdx.bin").read_bytes())
    raw[where] ^= 0x40
    with pytest.raises(QuoteParseError):
        parse_hcl_report(bytes(raw))


def test_real_runtime_data_sample_parses() -> None:
    from umbra.attest.azure import parse_runtime_data

    rt = parse_runtime_data((AZ / "var-data.bin").read_bytes())
    assert rt.ak.key_size == 2048


def test_real_vtpm_quote_verifies_with_its_ak_and_nonce() -> None:
    msg, sig, pcrs = _vtpm_quote()
    quote, reasons = verify_tpm_quote(msg, sig, pcrs, _ak(), b"challenge")
    assert reasons == []
    assert quote is not None
    assert quote.pcr_indices == tuple(range(24))
    assert quote.extra_data == b"challenge"


def test_real_vtpm_quote_nonce_mismatch() -> None:
    msg, sig, pcrs = _vtpm_quote()
    _, reasons = verify_tpm_quote(msg, sig, pcrs, _ak(), b"challengf")
    assert reasons == ["vTPM quote nonce does not match the expected value (stale or replayed?)"]


def test_real_vtpm_quote_other_key_refused() -> None:
    msg, sig, pcrs = _vtpm_quote()
    other = parse_hcl_report((AZ / "hcl-report-tdx.bin").read_bytes()).runtime_data.ak
    _, reasons = verify_tpm_quote(msg, sig, pcrs, other, b"challenge")
    assert reasons == ["vTPM quote signature does not verify with the attestation key"]


def test_real_vtpm_quote_pcr_values_are_bound() -> None:
    msg, sig, pcrs = _vtpm_quote()
    forged = dict(pcrs)
    forged[7] = bytes(32)
    _, reasons = verify_tpm_quote(msg, sig, forged, _ak(), b"challenge")
    assert reasons == ["PCR values do not match the digest the vTPM signed"]
    del forged[7]
    _, reasons = verify_tpm_quote(msg, sig, forged, _ak(), b"challenge")
    assert "but the quote selects" in reasons[0]


def test_real_vtpm_quote_every_bit_flip_is_refused() -> None:
    """Flip each bit of the signed message and of the signature: none verifies."""
    msg, sig, pcrs = _vtpm_quote()
    ak = _ak()
    accepted = 0
    for blob_is_msg, blob in ((True, msg), (False, sig)):
        for bit in range(8 * len(blob)):
            b = bytearray(blob)
            b[bit // 8] ^= 1 << (bit % 8)
            m, s = (bytes(b), sig) if blob_is_msg else (msg, bytes(b))
            _, reasons = verify_tpm_quote(m, s, pcrs, ak, b"challenge")
            accepted += not reasons
    assert accepted == 0


def test_tpm_attest_is_strict() -> None:
    msg, _, _ = _vtpm_quote()
    with pytest.raises(QuoteParseError, match="trailing"):
        parse_tpm_quote(msg + b"\0")
    with pytest.raises(QuoteParseError, match="truncated"):
        parse_tpm_quote(msg[:-1])
    with pytest.raises(QuoteParseError, match="magic"):
        parse_tpm_quote(b"\0" + msg[1:])


# --- the whole chain on the simulated Azure CVM ---


@pytest.fixture
def cvm(pki: SimulatedPki) -> SimulatedAzureCvm:
    return SimulatedAzureCvm(pki)


def _verifier(pki: SimulatedPki, collateral: Collateral, release: ReleaseManifest) -> Verifier:
    return Verifier(
        MeasurementPolicy(release=release),
        StaticCollateral(collateral),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )


def _verify(
    pki: SimulatedPki,
    collateral: Collateral,
    cvm: SimulatedAzureCvm,
    evidence: bytes,
    expected: bytes | None = BINDING,
    **release: object,
) -> Verdict:
    v = _verifier(pki, collateral, cvm.release_manifest(**release))
    return v.verify(evidence, expected_report_data=expected, now=T_SIM)


def test_simulated_azure_chain_passes(
    pki: SimulatedPki, sim_collateral: Collateral, cvm: SimulatedAzureCvm
) -> None:
    evidence = cvm.source().get_quote(BINDING)
    verdict = _verify(pki, sim_collateral, cvm, evidence)
    assert verdict.ok, verdict.reasons
    assert verdict.platform == "azure-tdx"
    assert verdict.pcrs[0] == cvm.pcrs[0].hex()
    assert verdict.to_json()["failures"] == []


def test_azure_binding_replay_refused(
    pki: SimulatedPki, sim_collateral: Collateral, cvm: SimulatedAzureCvm
) -> None:
    evidence = cvm.source().get_quote(BINDING)
    verdict = _verify(pki, sim_collateral, cvm, evidence, expected=bytes(64))
    assert not verdict.ok
    assert verdict.failed_steps == [Step.BINDING]
    assert any("user-data" in r for r in verdict.reasons)
    assert any("nonce" in r for r in verdict.reasons)


def test_azure_stale_vtpm_quote_refused(
    pki: SimulatedPki, sim_collateral: Collateral, cvm: SimulatedAzureCvm
) -> None:
    """A fresh HCL report with an old vTPM quote (other nonce): the nonce gives it away."""
    old = decode_envelope(cvm.source().get_quote(bytes(64)))
    new = decode_envelope(cvm.source().get_quote(BINDING))
    mixed = AzureEvidence(new.td_quote, new.hcl_report, old.tpm_attest, old.tpm_signature, old.pcrs)
    verdict = _verify(pki, sim_collateral, cvm, mixed.encode())
    assert verdict.failed_steps == [Step.BINDING]
    assert verdict.reasons == [
        "vTPM quote nonce does not match the expected value (stale or replayed?)"
    ]
    assert tpm_nonce_for(BINDING) != tpm_nonce_for(bytes(64))


def test_azure_pcr_policy_applies(
    pki: SimulatedPki, sim_collateral: Collateral, cvm: SimulatedAzureCvm
) -> None:
    evidence = cvm.source().get_quote(BINDING)
    verdict = _verify(pki, sim_collateral, cvm, evidence, pcrs={4: ["00" * 32]})
    assert verdict.failed_steps == [Step.MEASUREMENT]
    assert verdict.reasons[0].startswith("PCR4 ")


def test_azure_other_vm_runtime_data_refused(
    pki: SimulatedPki, sim_collateral: Collateral, cvm: SimulatedAzureCvm
) -> None:
    """Another CVM's HCL report (its own AK, its own vTPM quote) beside this CVM's TD quote."""
    other = SimulatedAzureCvm(pki)
    mine = decode_envelope(cvm.source().get_quote(BINDING))
    theirs = decode_envelope(other.source().get_quote(BINDING))
    spliced = AzureEvidence(
        mine.td_quote, theirs.hcl_report, theirs.tpm_attest, theirs.tpm_signature, theirs.pcrs
    )
    verdict = _verify(pki, sim_collateral, cvm, spliced.encode())
    assert not verdict.ok
    assert Step.BINDING in verdict.failed_steps or Step.PLATFORM in verdict.failed_steps
    # and this CVM's vTPM quote beside the other's runtime data: the AK does not match
    forged = AzureEvidence(
        theirs.td_quote, theirs.hcl_report, mine.tpm_attest, mine.tpm_signature, mine.pcrs
    )
    verdict = _verify(pki, sim_collateral, cvm, forged.encode())
    assert "vTPM quote signature does not verify with the attestation key" in verdict.reasons


def test_azure_evidence_and_platform_must_agree(
    pki: SimulatedPki, sim_collateral: Collateral, cvm: SimulatedAzureCvm
) -> None:
    evidence = cvm.source().get_quote(BINDING)
    bare = decode_envelope(evidence).td_quote
    verdict = _verify(pki, sim_collateral, cvm, bare)
    assert verdict.failed_steps == [Step.POLICY]
    tdx_release = SimulatedTdx(pki).release_manifest()
    verdict = _verifier(pki, sim_collateral, tdx_release).verify(evidence, now=T_SIM)
    assert verdict.failed_steps == [Step.POLICY]


def test_azure_envelope_bit_flips_never_accepted(
    pki: SimulatedPki, sim_collateral: Collateral, cvm: SimulatedAzureCvm
) -> None:
    """A sample of single-bit flips across every field of the envelope: none is accepted."""
    evidence = cvm.source().get_quote(BINDING)
    v = _verifier(pki, sim_collateral, cvm.release_manifest())
    assert v.verify(evidence, expected_report_data=BINDING, now=T_SIM).ok
    env = decode_envelope(evidence)
    # The HCL report's CPUSVN and MAC: no quote repeats them and only the TDX module on that host
    # can check the MAC, so the verifier reads neither; REPORTTYPE.VERSION may be 0 or 1 (TDX
    # 1.0 / 1.5 modules) under a v4 quote (spec: "what is not authenticated").
    td_at = evidence.index(env.hcl_report) + 32
    unread = set(range(td_at + 16, td_at + 32)) | set(range(td_at + 224, td_at + 256))
    unread.add(td_at + 2)
    accepted = []
    step = max(1, len(evidence) * 8 // 600)
    for bit in range(0, len(evidence) * 8, step):
        if bit // 8 in unread:
            continue
        b = bytearray(evidence)
        b[bit // 8] ^= 1 << (bit % 8)
        if v.verify(bytes(b), expected_report_data=BINDING, now=T_SIM).ok:
            accepted.append(bit)
    assert accepted == []


def test_azure_source_refuses_a_paravisor_that_ignores_user_data(
    pki: SimulatedPki, cvm: SimulatedAzureCvm
) -> None:
    class Deaf(SimulatedAzureCvm):
        def nv_write(self, index: int, data: bytes) -> None:
            pass

    deaf = Deaf(pki)
    with pytest.raises(QuoteSourceError, match="does not carry the user data"):
        AzureVtpmSource(deaf, deaf).get_quote(BINDING)
    with pytest.raises(QuoteSourceError, match="64 bytes"):
        cvm.source().get_quote(b"short")


def test_missing_vtpm_is_a_clear_error(tmp_path: Path) -> None:
    vtpm = Tpm2ToolsVtpm(device=tmp_path / "tpmrm0")
    with pytest.raises(QuoteSourceError, match=r"no vTPM at .*not an Azure confidential VM"):
        AzureVtpmSource(vtpm, None).get_quote(BINDING)


def test_release_manifest_platform_rules() -> None:
    base = {"apiVersion": "umbra/v1", "kind": "ReleaseManifest", "name": "r", "tee": "tdx",
            "mrtd": ["00" * 48]}  # fmt: skip
    with pytest.raises(ValidationError, match="needs pcrs"):
        ReleaseManifest.model_validate({**base, "platform": "azure-tdx"})
    with pytest.raises(ValidationError, match="needs rtmr0"):
        ReleaseManifest.model_validate(base)
    with pytest.raises(ValidationError, match="RTMRs are zero"):
        ReleaseManifest.model_validate(
            {**base, "platform": "azure-tdx", "pcrs": {"4": ["00" * 32]}, "rtmr0": ["00" * 48]}
        )
    ok = ReleaseManifest.model_validate(
        {**base, "platform": "azure-tdx", "pcrs": {"4": ["00" * 32]}}
    )
    assert ok.pcrs == {4: ["00" * 32]}


def test_imds_client_against_a_loopback_stand_in(cvm: SimulatedAzureCvm) -> None:
    """`ImdsTdQuote` speaks HTTP to a loopback stand-in for IMDS's /acc/tdquote."""
    import base64
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from umbra.attest.azure_source import ImdsTdQuote

    seen: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            report = base64.urlsafe_b64decode(body["report"] + "==")
            seen.append(report)
            quote = cvm.td_quote(report)
            out = json.dumps({"quote": base64.urlsafe_b64encode(quote).decode().rstrip("=")})
            self.send_response(200 if self.path == "/acc/tdquote" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(out.encode())

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/acc/tdquote"
        source = AzureVtpmSource(cvm, ImdsTdQuote(url))
        evidence = decode_envelope(source.get_quote(BINDING))
        assert seen == [parse_hcl_report(evidence.hcl_report).td_report_raw]
        assert evidence.td_quote[:2] == b"\x04\x00"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    with pytest.raises(QuoteSourceError, match="unreachable"):
        ImdsTdQuote("http://127.0.0.1:9/acc/tdquote", timeout=2).td_quote(bytes(1024))


def test_hostile_runtime_data_is_a_parse_error() -> None:
    """Found by the envelope bit-flip test: an even RSA exponent made `cryptography` raise
    ValueError out of the parser. Deep JSON nesting is refused the same way."""
    from umbra.attest.azure import parse_runtime_data

    n = "x" * 342  # 2048-bit modulus in base64url
    for doc in (
        b'{"keys":[{"kid":"HCLAkPub","kty":"RSA","e":"AQAA","n":"' + n.encode() + b'"}]}',
        b'{"a":' * 50_000,
    ):
        with pytest.raises(QuoteParseError):
            parse_runtime_data(doc)


def test_deeply_nested_json_never_escapes_as_recursion_error() -> None:
    from umbra.attest.atls import _decode_evidence
    from umbra.attest.errors import ATLSError, EventLogError
    from umbra.attest.eventlog import load_event_log

    with pytest.raises(EventLogError):
        load_event_log(b"[" * 100_000)
    with pytest.raises(ATLSError):
        _decode_evidence(b"[" * 100_000)
