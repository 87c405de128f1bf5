"""Event logs (dstack JSON and the binary CCEL), digest recomputation and RTMR replay.

RTMR3 is the runtime register: it accepts runtime events (dstack type 0x08000001) and nothing
else, so no event there can step out of the named-event checks by carrying another type (a
re-typed runtime event would otherwise replay its logged digest and vanish from every check).

Digests are recomputed, never taken from the log, wherever the TCG or dstack rules define them
from the event's own bytes: runtime events, EV_SEPARATOR, EV_EFI_ACTION and
EV_EFI_VARIABLE_DRIVER_CONFIG. Other firmware events (RTMR0-2 only) measure data that is not in
the log (e.g. a PE image's Authenticode hash); their logged digest is replayed as is, which is
safe only because RTMR0-2 are pinned to golden values by the measurement policy and no
named-event check ever reads those events. For the same reason a boot event whose payload was
stripped (dstack's current log format keeps only digests) replays its logged digest.

Parsing is linear in the log's size and bounded: at most MAX_LOG_BYTES and MAX_EVENTS records.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from umbra.attest.errors import EventLogError

RUNTIME_EVENT_TYPE = 0x08000001
EV_NO_ACTION = 0x00000003
EV_SEPARATOR = 0x00000004
EV_EFI_VARIABLE_DRIVER_CONFIG = 0x80000001
EV_EFI_ACTION = 0x80000007
_HASH_OF_DATA_TYPES = frozenset({EV_SEPARATOR, EV_EFI_ACTION, EV_EFI_VARIABLE_DRIVER_CONFIG})

RTMR_COUNT = 4
DIGEST_LEN = 48
ZERO_MR = bytes(DIGEST_LEN)
MAX_EVENTS = 4096
MAX_PAYLOAD = 1 << 20
MAX_LOG_BYTES = 2 << 20
MAX_DIGESTS_PER_EVENT = 8
RUNTIME_IMR = 3
TPM_ALG_SHA384 = 0x000C
_HEADER = struct.Struct("<III")  # mr_index, event type, digest count: one unpack per event
_ALG_SIZES = {0x0004: 20, 0x000B: 32, 0x000C: 48, 0x000D: 64, 0x0012: 32}


@dataclass(frozen=True)
class Event:
    imr: int  # RTMR index 0-3
    event_type: int
    digest: bytes  # the digest replayed: recomputed where the rules allow
    name: str  # runtime events only; "" otherwise
    payload: bytes
    recomputed: bool


def runtime_event_digest(name: str, payload: bytes) -> bytes:
    """dstack's rule: SHA-384(u32le(0x08000001) ‖ ":" ‖ name ‖ ":" ‖ payload)."""
    h = hashlib.sha384(struct.pack("<I", RUNTIME_EVENT_TYPE))
    h.update(b":" + name.encode() + b":" + payload)
    return h.digest()


def extend(mr: bytes, digest: bytes) -> bytes:
    return hashlib.sha384(mr + digest).digest()


def make_event(imr: int, event_type: int, name: str, payload: bytes, logged: bytes) -> Event:
    if not 0 <= imr < RTMR_COUNT:
        raise EventLogError(f"event {name or hex(event_type)}: IMR {imr} is not an RTMR (0-3)")
    if imr == RUNTIME_IMR and event_type != RUNTIME_EVENT_TYPE:
        raise EventLogError(not_runtime(event_type))
    if event_type == RUNTIME_EVENT_TYPE:
        digest, recomputed = runtime_event_digest(name, payload), True
    elif event_type in _HASH_OF_DATA_TYPES and (payload or not logged):
        digest, recomputed = hashlib.sha384(payload).digest(), True
    else:
        if len(logged) != DIGEST_LEN:
            raise EventLogError(
                f"event type {event_type:#x}: digest is {len(logged)} bytes, not {DIGEST_LEN}"
            )
        digest, recomputed = logged, False
    if recomputed and logged and logged != digest:
        label = name or f"type {event_type:#x}"
        raise EventLogError(
            f"event {label!r} (IMR {imr}): logged digest does not match its name and payload"
        )
    return Event(
        imr,
        event_type,
        digest,
        name if event_type == RUNTIME_EVENT_TYPE else "",
        payload,
        recomputed,
    )


def not_runtime(event_type: int) -> str:
    """The one refusal for a non-runtime event on RTMR3 (parsers and the verifier say it)."""
    return (
        f"event of type {event_type:#x} on RTMR3: RTMR3 accepts only runtime events "
        f"(type {RUNTIME_EVENT_TYPE:#010x})"
    )


def make_runtime_event(imr: int, name: str, payload: bytes) -> Event:
    return make_event(imr, RUNTIME_EVENT_TYPE, name, payload, b"")


def _check_size(size: int) -> None:
    if size > MAX_LOG_BYTES:
        raise EventLogError(f"event log of {size} bytes is larger than {MAX_LOG_BYTES}")


def parse_dstack_event_log(text: str | bytes) -> list[Event]:
    """Parse dstack's JSON event log: [{imr, event_type, digest, event, event_payload}, ...]."""
    _check_size(len(text))
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # deep nesting: hostile
        raise EventLogError(f"event log is not JSON: {exc}") from None
    if not isinstance(doc, list):
        raise EventLogError("event log must be a JSON list")
    if len(doc) > MAX_EVENTS:
        raise EventLogError(f"event log has {len(doc)} events, more than {MAX_EVENTS}")
    events = []
    for i, item in enumerate(doc):
        if not isinstance(item, dict):
            raise EventLogError(f"event {i}: must be an object")
        try:
            imr = item["imr"]
            event_type = item["event_type"]
            name = item.get("event", "")
            payload = bytes.fromhex(item.get("event_payload", ""))
            logged = bytes.fromhex(item.get("digest", ""))
        except KeyError as exc:
            raise EventLogError(f"event {i}: missing {exc.args[0]!r}") from None
        except (TypeError, ValueError):
            raise EventLogError(f"event {i}: digest/event_payload must be hex strings") from None
        if type(imr) is not int or type(event_type) is not int or not isinstance(name, str):
            raise EventLogError(f"event {i}: imr/event_type must be integers, event a string")
        if not 0 <= event_type < 1 << 32:
            raise EventLogError(f"event {i}: event_type out of range")
        if len(payload) > MAX_PAYLOAD:
            raise EventLogError(f"event {i}: payload larger than {MAX_PAYLOAD} bytes")
        events.append(make_event(imr, event_type, name, payload, logged))
    return events


def dump_dstack_event_log(events: Sequence[Event]) -> str:
    return json.dumps(
        [
            {
                "imr": e.imr,
                "event_type": e.event_type,
                "digest": e.digest.hex(),
                "event": e.name,
                "event_payload": e.payload.hex(),
            }
            for e in events
        ]
    )


def parse_ccel(data: bytes) -> list[Event]:
    """Parse a TCG2 crypto-agile log as exposed by the ACPI CCEL table.

    CCEL MR index 0 is MRTD (not extendable at runtime, so refused here); 1-4 are RTMR0-3.
    EV_NO_ACTION events are informational and not extended (index 0-3 only: index 4 is RTMR3,
    which accepts runtime events only), wherever they appear in the log. The log ends at the
    data's end or where only padding follows: TDVF fills the whole log area (LAML bytes, which
    is what /sys/firmware/acpi/tables/data/CCEL holds) with 0xFF before logging; 0x00 is
    accepted too. Anything else after the last event is refused.
    """
    _check_size(len(data))
    pos = 0
    # Trailing padding is found once, not by rescanning the rest of the log at every event.
    end = min(len(data.rstrip(b"\xff")), len(data.rstrip(b"\0")))

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise EventLogError(f"CCEL truncated reading {what} at byte {pos}")
        out = data[pos : pos + n]
        pos += n
        return out

    def u32(what: str) -> int:
        return int(struct.unpack("<I", take(4, what))[0])

    # The first event is in the legacy SHA-1 layout and carries the Spec ID (algorithm sizes).
    u32("header.pcr_index")
    if u32("header.event_type") != EV_NO_ACTION:
        raise EventLogError("CCEL does not start with the Spec ID event (EV_NO_ACTION)")
    take(20, "header.digest")
    spec = take(u32("header.event_size"), "header.event")
    if not spec.startswith(b"Spec ID Event03\0") or len(spec) < 28:
        raise EventLogError("CCEL Spec ID event signature is not 'Spec ID Event03'")
    (n_algs,) = struct.unpack_from("<I", spec, 24)
    if len(spec) < 28 + 4 * n_algs:
        raise EventLogError("CCEL Spec ID event is truncated")
    sizes = {}
    for k in range(n_algs):
        alg, size = struct.unpack_from("<HH", spec, 28 + 4 * k)
        sizes[alg] = size
    if sizes.get(TPM_ALG_SHA384) != DIGEST_LEN:
        raise EventLogError("CCEL does not log SHA-384 digests")

    events: list[Event] = []
    records = 0
    while pos < end:
        records += 1
        if records > MAX_EVENTS:
            raise EventLogError(f"CCEL has more than {MAX_EVENTS} events")
        start = pos
        if data[pos : pos + 8] in (b"\xff" * 8, bytes(8)):  # no record: padding, then more
            raise EventLogError(f"CCEL has data after the padding that starts at byte {pos}")
        index, event_type, count = _HEADER.unpack(take(12, "event header"))
        # Checked before the digests are read: bytes after the padding (or anything else that
        # is no record) stop here with the offset, not as a misleading digest-count error.
        if not 0 <= index <= RTMR_COUNT:
            raise EventLogError(
                f"CCEL record at byte {start} is for MR index {index}: not a measurement register"
            )
        digests: dict[int, bytes] = {}
        if count > MAX_DIGESTS_PER_EVENT:
            bound = MAX_DIGESTS_PER_EVENT
            raise EventLogError(
                f"CCEL event at byte {start} has {count} digests, more than {bound}"
            )
        for _ in range(count):
            alg = int(struct.unpack("<H", take(2, "event.alg"))[0])
            size = sizes.get(alg, _ALG_SIZES.get(alg))
            if size is None:
                raise EventLogError(f"CCEL event uses unknown hash algorithm {alg:#x}")
            digests[alg] = take(size, "event.digest")
        size = u32("event.size")
        if size > MAX_PAYLOAD:
            raise EventLogError(f"CCEL event payload of {size} bytes is too large")
        payload = take(size, "event.data")
        if index == RUNTIME_IMR + 1 and event_type != RUNTIME_EVENT_TYPE:
            raise EventLogError(not_runtime(event_type))  # EV_NO_ACTION too: no hiding there
        if event_type == EV_NO_ACTION:
            continue
        if index == 0:
            raise EventLogError(f"CCEL event for MR index {index}: only RTMRs (1-4) extend")
        if TPM_ALG_SHA384 not in digests:
            raise EventLogError("CCEL event lacks a SHA-384 digest")
        name = ""
        if event_type == RUNTIME_EVENT_TYPE:
            name, payload = _split_runtime(payload)
        events.append(make_event(index - 1, event_type, name, payload, digests[TPM_ALG_SHA384]))
    return events


def _split_runtime(data: bytes) -> tuple[str, bytes]:
    # Our CCEL encoding of a runtime event: u32le name length ‖ name ‖ payload.
    if len(data) < 4:
        raise EventLogError("runtime event data is truncated")
    (n,) = struct.unpack_from("<I", data)
    if 4 + n > len(data):
        raise EventLogError("runtime event name is truncated")
    try:
        return data[4 : 4 + n].decode(), data[4 + n :]
    except UnicodeDecodeError:
        raise EventLogError("runtime event name is not UTF-8") from None


def dump_ccel(events: Sequence[Event]) -> bytes:
    """Encode events as a CCEL-style TCG2 log (used by the simulator and tests)."""
    spec = b"Spec ID Event03\0" + struct.pack("<IBBBBI", 0, 0, 2, 0, 2, 1)
    spec += struct.pack("<HH", TPM_ALG_SHA384, DIGEST_LEN) + b"\0"
    out = struct.pack("<II", 0, EV_NO_ACTION) + bytes(20) + struct.pack("<I", len(spec)) + spec
    for e in events:
        data = e.payload
        if e.event_type == RUNTIME_EVENT_TYPE:
            raw_name = e.name.encode()
            data = struct.pack("<I", len(raw_name)) + raw_name + e.payload
        out += struct.pack("<IIIH", e.imr + 1, e.event_type, 1, TPM_ALG_SHA384) + e.digest
        out += struct.pack("<I", len(data)) + data
    return out


def replay(events: Sequence[Event]) -> tuple[bytes, bytes, bytes, bytes]:
    """SHA-384 extend each event's digest into its RTMR, all starting from zero."""
    mrs = [ZERO_MR] * RTMR_COUNT
    for e in events:
        mrs[e.imr] = extend(mrs[e.imr], e.digest)
    return (mrs[0], mrs[1], mrs[2], mrs[3])


def load_event_log(data: bytes) -> list[Event]:
    """Sniff the format: JSON (dstack) if it starts with '[' after whitespace, else CCEL."""
    if data.lstrip()[:1] == b"[":
        return parse_dstack_event_log(data)
    return parse_ccel(data)
