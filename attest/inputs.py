"""Evidence as people hand it over: raw bytes, hex (with or without 0x, any whitespace) or base64.

One function decides, and refuses anything else with one line naming what it saw. A binary TDX
quote starts with its u16 version (4 or 5) and attestation-key type 2; an Azure envelope with its
magic; neither starts with a printable character, so text and binary cannot be confused.
"""

from __future__ import annotations

import base64
import binascii
import re
import string

from umbra.attest.azure import ENVELOPE_MAGIC
from umbra.attest.errors import EvidenceFormatError

_TEXT = frozenset(string.printable.encode())
_HEX = re.compile(r"[0-9a-fA-F]*")
_B64 = re.compile(r"[A-Za-z0-9+/_-]*={0,2}")
MAX_INPUT = 1 << 20


def _binary(data: bytes) -> bool:
    return data.startswith(ENVELOPE_MAGIC) or data[:4] in (b"\x04\x00\x02\x00", b"\x05\x00\x02\x00")


def decode_evidence(data: bytes) -> bytes:
    """Return the evidence bytes (a TDX quote or an Azure envelope), whatever the encoding."""
    if len(data) > MAX_INPUT:
        raise EvidenceFormatError(f"input of {len(data)} bytes is larger than {MAX_INPUT}")
    if not data:
        raise EvidenceFormatError("input is empty")
    if _binary(data):
        return data
    if any(b not in _TEXT for b in data[:64]):
        raise EvidenceFormatError(
            f"binary input that is not a TDX quote (starts {data[:4].hex()}; a quote starts "
            "04000200 or 05000200)"
        )
    text = "".join(data.decode("ascii", errors="replace").split())
    body = text[2:] if text[:2] in ("0x", "0X") else text
    if _HEX.fullmatch(body):
        if len(body) % 2:
            raise EvidenceFormatError(f"hex input has an odd number of digits ({len(body)})")
        out = bytes.fromhex(body)
    elif _B64.fullmatch(text):
        try:
            out = base64.b64decode(
                text.replace("-", "+").replace("_", "/") + "=" * (-len(text) % 4)
            )
        except (binascii.Error, ValueError):
            raise EvidenceFormatError("input looks like base64 but does not decode") from None
    else:
        bad = next((c for c in text if not (c.isalnum() or c in "+/_-=")), None)
        # Every character may be base64's and still not be base64: '=' padding mid-text or >2.
        why = f"character {bad!r}" if bad is not None else "misplaced '=' padding"
        raise EvidenceFormatError(f"input is neither hex nor base64 ({why})")
    if not _binary(out):
        raise EvidenceFormatError(
            f"decoded {len(out)} bytes that are not a TDX quote (starts {out[:4].hex() or 'empty'})"
        )
    return out
