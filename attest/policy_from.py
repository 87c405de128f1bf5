"""A release manifest that pins the measurements found in one piece of evidence.

This is how an operator bootstraps a policy: verify a quote from a machine they trust (DCAP and
TCB only), read its measurements, and paste them as the release's golden values. The result
trusts whatever that machine booted: it is a starting point to review, never a verdict.
"""

from __future__ import annotations

from typing import Literal

from umbra.attest.azure import decode_envelope, is_azure_envelope
from umbra.attest.measurement import ReleaseManifest
from umbra.attest.quote import parse_quote

# Azure boot PCRs that are stable across boots of one image: firmware, its configuration, the
# boot manager and Secure Boot state. Others (IMA, debug, resettable) would make a brittle pin.
AZURE_PINNED_PCRS = tuple(range(8))


def release_from_evidence(
    raw: bytes, *, name: str = "pinned-release", tee: Literal["tdx", "simulated"] = "tdx"
) -> ReleaseManifest:
    """Raises `QuoteParseError` if the evidence does not parse; verifies nothing."""
    doc: dict[str, object] = {
        "apiVersion": "umbra/v1",
        "kind": "ReleaseManifest",
        "name": name,
        "tee": tee,
    }
    if is_azure_envelope(raw):
        ev = decode_envelope(raw)
        td = parse_quote(ev.td_quote).td_report
        doc["platform"] = "azure-tdx"
        doc["pcrs"] = {i: [ev.pcrs[i].hex()] for i in AZURE_PINNED_PCRS if i in ev.pcrs}
    else:
        td = parse_quote(raw).td_report
        doc.update({f"rtmr{i}": [td.rtmrs[i].hex()] for i in range(3)})
        if any(td.rtmrs[3]):
            # Runtime events were extended and the quote alone cannot name them: a policy that
            # refused unnamed ones would refuse the very quote it was made from. Name them
            # under `events:` (from the verified log) and drop this to pin them.
            doc["other_runtime_events"] = "allow"
    doc["mrtd"] = [td.mr_td.hex()]
    return ReleaseManifest.model_validate(doc)
