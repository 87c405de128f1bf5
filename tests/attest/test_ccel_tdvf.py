"""parse_ccel on logs shaped like a TD firmware's (TDVF): the log area padded to its length,
EV_NO_ACTION records among the measurements, and the bounds that keep a hostile one cheap."""

from __future__ import annotations

import struct

import pytest

from umbra.attest.errors import EventLogError
from umbra.attest.eventlog import (
    EV_EFI_ACTION,
    EV_NO_ACTION,
    EV_SEPARATOR,
    MAX_DIGESTS_PER_EVENT,
    TPM_ALG_SHA384,
    Event,
    dump_ccel,
    make_event,
    parse_ccel,
    replay,
)

HEADER = dump_ccel([])
FIRMWARE = [
    make_event(0, EV_EFI_ACTION, "", b"firmware", b""),
    make_event(0, EV_SEPARATOR, "", b"\0\0\0\0", b""),
    make_event(1, EV_EFI_ACTION, "", b"kernel", b""),
    make_event(2, EV_EFI_ACTION, "", b"ends in padding bytes \xff\xff", b""),
]


def records(events: list[Event]) -> bytes:
    return dump_ccel(events)[len(HEADER) :]


def no_action(index: int, count: int = 1) -> bytes:
    digests = struct.pack("<H", TPM_ALG_SHA384) + bytes(48)
    data = b"StartupLocality\0\x03"
    return (
        struct.pack("<III", index, EV_NO_ACTION, count)
        + digests * count
        + (struct.pack("<I", len(data)) + data)
    )


@pytest.mark.parametrize("pad", [b"\xff", b"\0"])
def test_the_log_area_padding_ends_the_log_and_the_last_event_is_read_whole(pad: bytes) -> None:
    blob = HEADER + records(FIRMWARE)
    assert parse_ccel(blob + pad * (64 * 1024 - len(blob))) == FIRMWARE
    assert parse_ccel(blob) == FIRMWARE  # a log area filled to the last byte
    assert parse_ccel(blob).pop().payload.endswith(b"\xff\xff")


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_no_action_records_mid_log_are_skipped_and_extend_nothing(index: int) -> None:
    blob = HEADER + records(FIRMWARE[:2]) + no_action(index) + no_action(index, count=0)
    blob += records(FIRMWARE[2:]) + b"\xff" * 4096
    events = parse_ccel(blob)
    assert events == FIRMWARE
    assert replay(events) == replay(FIRMWARE)


def test_a_digest_count_over_the_bound_is_refused_mid_log_with_its_offset() -> None:
    at = len(HEADER + records(FIRMWARE[:1]))
    count = MAX_DIGESTS_PER_EVENT + 1
    blob = HEADER + records(FIRMWARE[:1]) + no_action(1, count=count) + records(FIRMWARE[1:])
    with pytest.raises(EventLogError, match=f"at byte {at} has {count} digests"):
        parse_ccel(blob)


def test_anything_but_padding_after_the_last_event_is_refused() -> None:
    blob = HEADER + records(FIRMWARE)
    for pad in (b"\xff", b"\0"):
        with pytest.raises(
            EventLogError, match=f"after the padding that starts at byte {len(blob)}"
        ):
            parse_ccel(blob + pad * 64 + b"\x01\x02\x03\x04" + pad * 64)
    with pytest.raises(EventLogError, match=f"record at byte {len(blob)} is for MR index 5"):
        parse_ccel(blob + struct.pack("<III", 5, 1, 0) + b"\xff" * 64)
    with pytest.raises(EventLogError, match="truncated"):
        parse_ccel(blob + struct.pack("<I", 1) + b"\xff" * 4)  # half a record header
    with pytest.raises(EventLogError, match="truncated"):
        parse_ccel(blob[:-3])  # the last event cut short, no padding


def test_a_spec_id_event_without_sha384_is_refused() -> None:
    sha256_only = HEADER.replace(
        struct.pack("<HH", TPM_ALG_SHA384, 48), struct.pack("<HH", 0xB, 32)
    )
    with pytest.raises(EventLogError, match="SHA-384"):
        parse_ccel(sha256_only + records(FIRMWARE))
