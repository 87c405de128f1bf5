"""A reader for a TPM firmware's TCG2 crypto-agile event log (Linux's
/sys/kernel/security/tpm0/binary_bios_measurements: the firmware's log, then the final events
table), used only to check images.td_boot against a real boot. Every digest bank is kept."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

ALGS = {
    0x0004: ("sha1", 20),
    0x000B: ("sha256", 32),
    0x000C: ("sha384", 48),
    0x000D: ("sha512", 64),
}
EV_NO_ACTION = 0x3


@dataclass(frozen=True)
class LoggedEvent:
    pcr: int
    event_type: int
    digests: dict[str, bytes]
    data: bytes


def parse_tcg2_log(blob: bytes) -> list[LoggedEvent]:
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(blob):
            raise ValueError(f"log truncated at byte {pos}")
        out = blob[pos : pos + n]
        pos += n
        return out

    # The Spec ID event, in the SHA-1 layout: PCR, type, 20-byte digest, size, data.
    _pcr, event_type = struct.unpack("<II", take(8))
    take(20)
    (size,) = struct.unpack("<I", take(4))
    spec = take(size)
    if event_type != EV_NO_ACTION or not spec.startswith(b"Spec ID Event03\0"):
        raise ValueError("not a crypto-agile TCG2 log")
    events = []
    while pos < len(blob):
        pcr, event_type, count = struct.unpack("<III", take(12))
        digests = {}
        for _ in range(count):
            (alg,) = struct.unpack("<H", take(2))
            name, length = ALGS[alg]
            digests[name] = take(length)
        (size,) = struct.unpack("<I", take(4))
        events.append(LoggedEvent(pcr, event_type, digests, take(size)))
    return events


def replay_pcrs(events: list[LoggedEvent], bank: str) -> dict[int, bytes]:
    size = hashlib.new(bank).digest_size
    pcrs: dict[int, bytes] = {}
    for e in events:
        if e.event_type == EV_NO_ACTION:
            continue
        pcrs[e.pcr] = hashlib.new(bank, pcrs.get(e.pcr, bytes(size)) + e.digests[bank]).digest()
    return pcrs
