"""images.td_boot, fast: the TD's RTMR1/RTMR2 computed from a small UKI (the host's systemd
stub with stand-in payloads) and a GPT, the events' shapes against the real dstack TD's
firmware log (tests/data/tdx), and bad input refused with the file named. The check against a
real boot's log is tests/images/test_td_boot_swtpm.py."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from umbra.attest.eventlog import (
    EV_EFI_ACTION,
    EV_SEPARATOR,
    Event,
    parse_dstack_event_log,
    replay,
)
from umbra.images.pe import authenticode_digest
from umbra.images.td_boot import (
    CALLING,
    EV_EFI_BOOT_SERVICES_APPLICATION,
    EV_EFI_GPT_EVENT,
    EV_EVENT_TAG,
    EV_IPL,
    EXIT_BOOT_SERVICES,
    RETURNING,
    Bank,
    TdBootError,
    TdBootGolden,
    boot_measurements,
    extra_cpio,
    golden_rtmrs,
    gpt_event_data,
    rtmr_of_pcr,
)
from umbra.images.uki import OS_RELEASE, build_uki, kernel_cmdline

from .test_uki import STUB, _need

DSTACK = Path(__file__).resolve().parent.parent / "data" / "tdx" / "dstack_quote_report.json"
CMDLINE = kernel_cmdline("cd" * 32)
ESP_TYPE = bytes.fromhex("28732ac11ff8d211ba4b00a0c93ec93b")


def fake_disk(path: Path, parts: int = 3) -> Path:
    """A GPT (primary header at LBA 1, 128 entries of 128 bytes at LBA 2), `parts` used."""
    entries = b""
    for i in range(128):
        used = i < parts
        entry = (ESP_TYPE if used else bytes(16)) + bytes([i]) * 16 if used else bytes(32)
        entries += entry + struct.pack("<QQQ", 2048 * (i + 1), 2048 * (i + 2) - 1, 0) + bytes(72)
    header = b"EFI PART" + struct.pack("<II", 0x10000, 92) + bytes(8)
    header += struct.pack("<QQQQ", 1, 99999, 34, 99966) + bytes(16)
    header += struct.pack("<QIII", 2, 128, 128, 0)
    path.write_bytes(bytes(512) + header + bytes(512 - len(header)) + entries)
    return path


@pytest.fixture
def uki(tmp_path: Path) -> Path:
    _need("objcopy")
    kernel, initrd = tmp_path / "vmlinuz", tmp_path / "initrd.img"
    kernel.write_bytes(bytes(range(256)) * 4000)
    initrd.write_bytes(b"initrd" * 50000)
    return build_uki(kernel, initrd, STUB, tmp_path / "uki.efi", CMDLINE).path


def test_pcrs_map_onto_rtmrs_as_tdvf_maps_them() -> None:
    pcrs = (1, 7, 2, 3, 4, 5, 6, 8, 9, 11, 15)
    assert [rtmr_of_pcr(p) for p in pcrs] == [0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2]
    for pcr in (0, 16, 23):
        with pytest.raises(TdBootError, match=f"PCR {pcr}"):
            rtmr_of_pcr(pcr)


def test_the_events_are_the_boot_paths_and_replay_to_the_golden_rtmrs(
    uki: Path, tmp_path: Path
) -> None:
    disk = fake_disk(tmp_path / "disk.raw")
    golden = golden_rtmrs(uki, disk)
    m = golden.measured
    kinds = [(x.pcr, x.event_type) for x in m]
    assert kinds[:4] == [
        (4, EV_EFI_ACTION),
        (4, EV_SEPARATOR),
        (5, EV_EFI_GPT_EVENT),
        (4, EV_EFI_BOOT_SERVICES_APPLICATION),
    ]
    assert kinds[-2:] == [(5, EV_EFI_ACTION)] * 2
    # systemd-stub: name then contents of each section, in the UKI spec's order (the stub's own
    # .sbat last), then the kernel's load options and initrd.
    stub = [x.label for x in m if x.pcr == 11]
    assert stub == [
        f"{s} ({what})"
        for s in (".linux", ".osrel", ".cmdline", ".initrd", ".sbat")
        for what in ("name", "contents")
    ]
    assert all(x.event_type == EV_IPL for x in m if x.pcr == 11)
    assert [x.label for x in m if x.pcr == 9] == ["LOADED_IMAGE::LoadOptions", "Linux initrd"]
    app = m[3]
    assert app.sha384.hex() == authenticode_digest(uki.read_bytes(), "sha384")
    assert app.digest(Bank.sha256).hex() == authenticode_digest(uki.read_bytes(), "sha256")
    cmdline = next(x for x in m if x.label == ".cmdline (contents)")
    assert cmdline.sha384 == hashlib.sha384(CMDLINE.encode()).digest()
    options = next(x for x in m if x.label == "LOADED_IMAGE::LoadOptions")
    assert options.sha384 == hashlib.sha384((CMDLINE + "\0").encode("utf-16-le")).digest()
    # The kernel's initrd is the .initrd section, padded to 4 bytes, then systemd-stub 257's
    # cpio of .osrel (as the real boot's log showed: tests/images/test_td_boot_swtpm.py).
    initrd = next(x for x in m if x.label == "Linux initrd")
    handed = b"initrd" * 50000 + extra_cpio(b"os-release", OS_RELEASE.encode())
    assert initrd.sha384 == hashlib.sha384(handed).digest()
    # RTMR1 holds PCR 4/5's events, RTMR2 PCR 9/11's, nothing else; the replay is the value.
    events = golden.events()
    assert {e.imr for e in events} == {1, 2}
    r = replay(events)
    assert (r[1], r[2]) == (golden.rtmr1, golden.rtmr2)
    assert r[0] == bytes(48)


def _golden_after(tmp_path: Path, uki: Path, disk: Path, offset_in: str) -> TdBootGolden:
    from umbra.images.pe import sections

    data = bytearray(uki.read_bytes())
    section = next(s for s in sections(bytes(data)) if s.name == offset_in)
    data[section.raw_ptr + 10] ^= 1
    changed = tmp_path / f"changed{offset_in}.efi"
    changed.write_bytes(bytes(data))
    return golden_rtmrs(changed, disk)


@pytest.mark.parametrize("section", [".linux", ".cmdline", ".initrd", ".osrel"])
def test_a_changed_byte_of_the_uki_changes_rtmr1_and_rtmr2(
    uki: Path, tmp_path: Path, section: str
) -> None:
    disk = fake_disk(tmp_path / "disk.raw")
    before = golden_rtmrs(uki, disk)
    after = _golden_after(tmp_path, uki, disk, section)
    assert after.rtmr1 != before.rtmr1  # the Authenticode hash covers every section
    assert after.rtmr2 != before.rtmr2  # and systemd-stub measures the section itself


def test_the_gpt_event_is_the_header_and_the_used_entries(tmp_path: Path, uki: Path) -> None:
    head = fake_disk(tmp_path / "disk.raw").read_bytes()
    data = gpt_event_data(head)
    assert data[:8] == b"EFI PART" and len(data) == 92 + 8 + 3 * 128
    assert struct.unpack_from("<Q", data, 92) == (3,)
    # Another partition table (one more partition) is another RTMR1.
    other = fake_disk(tmp_path / "other.raw", parts=4)
    assert golden_rtmrs(uki, other).rtmr1 != golden_rtmrs(uki, tmp_path / "disk.raw").rtmr1
    with pytest.raises(TdBootError, match="no GPT header"):
        gpt_event_data(bytes(4096), "x.raw")


def _dstack_firmware() -> list[Event]:
    report = json.loads(DSTACK.read_text())
    return [e for e in parse_dstack_event_log(report["event_log"]) if e.imr in (1, 2)]


def test_the_tdvf_events_are_the_real_tds(uki: Path, tmp_path: Path) -> None:
    """A real TD's TDVF (dstack's, direct kernel boot) logged the same RTMR1 actions and
    separator, byte for byte and digest for digest, and its kernel the same tagged-event
    layout into RTMR2, as the computation writes for our disk boot."""
    real = _dstack_firmware()
    ours = golden_rtmrs(uki, fake_disk(tmp_path / "disk.raw")).events()

    def fixed(events: list[Event]) -> set[tuple[int, int, bytes, bytes]]:
        return {
            (e.imr, e.event_type, e.payload, e.digest)
            for e in events
            if e.event_type in (EV_EFI_ACTION, EV_SEPARATOR)
        }

    assert fixed(real) == fixed(ours)
    assert {e.payload for e in real if e.event_type == EV_EFI_ACTION} == {
        CALLING,
        *EXIT_BOOT_SERVICES,
    }
    tags = [e.payload for e in ours if e.event_type == EV_EVENT_TAG]
    assert tags == [e.payload for e in real if e.event_type == EV_EVENT_TAG]
    # TDVF draws one separator into RTMR1 and none into RTMR2.
    assert [e.imr for e in real if e.event_type == EV_SEPARATOR] == [1]
    assert [e.imr for e in ours if e.event_type == EV_SEPARATOR] == [1]


def test_bad_input_is_refused_naming_the_file(uki: Path, tmp_path: Path) -> None:
    disk = fake_disk(tmp_path / "disk.raw")
    with pytest.raises(TdBootError, match=r"nothing\.efi: cannot read"):
        golden_rtmrs(tmp_path / "nothing.efi", disk)
    junk = tmp_path / "junk.efi"
    junk.write_bytes(b"not a PE")
    with pytest.raises(TdBootError, match=r"junk\.efi: not a PE image"):
        golden_rtmrs(junk, disk)
    with pytest.raises(TdBootError, match=r"stub\.efi: not a UKI of ours: no \.linux section"):
        boot_measurements(STUB.read_bytes(), gpt_event_data(disk.read_bytes()), "stub.efi")


def test_the_stubs_os_release_cpio_unpacks_with_cpio(tmp_path: Path) -> None:
    """The cpio systemd-stub generates is a newc archive GNU cpio unpacks: .extra/os-release,
    mode 0444, in a 0555 directory (its exact bytes are checked by the real boot's digest)."""
    if shutil.which("cpio") is None:
        pytest.skip("needs cpio")
    archive = extra_cpio(b"os-release", OS_RELEASE.encode())
    assert len(archive) % 4 == 0
    subprocess.run(["cpio", "-id", "--quiet"], input=archive, cwd=tmp_path, check=True)
    out = tmp_path / ".extra" / "os-release"
    assert out.read_text() == OS_RELEASE
    assert oct(out.stat().st_mode & 0o777) == "0o444"
    assert oct((tmp_path / ".extra").stat().st_mode & 0o777) == "0o555"


def test_a_returned_boot_attempt_is_another_rtmr1(uki: Path, tmp_path: Path) -> None:
    """TDVF logs a boot option it came back from as "Returning from…" then "Calling…" again
    (TdTcg2Dxe's OnReadyToBoot): a release computes none, so such a boot does not verify."""
    disk = fake_disk(tmp_path / "disk.raw")
    once = golden_rtmrs(uki, disk, returned_attempts=1)
    actions = [m.event_data for m in once.measured if m.event_type == EV_EFI_ACTION]
    assert actions == [CALLING, RETURNING, CALLING, *EXIT_BOOT_SERVICES]
    plain = golden_rtmrs(uki, disk)
    assert once.rtmr1 != plain.rtmr1 and once.rtmr2 == plain.rtmr2


def test_a_command_line_the_stub_would_rewrite_is_refused(tmp_path: Path) -> None:
    _need("objcopy")
    kernel, initrd = tmp_path / "vmlinuz", tmp_path / "initrd.img"
    kernel.write_bytes(b"k" * 4096)
    initrd.write_bytes(b"i" * 4096)
    odd = build_uki(kernel, initrd, STUB, tmp_path / "odd.efi", "root=x\tquiet é").path
    with pytest.raises(TdBootError, match=r"odd\.efi: \.cmdline is not printable ASCII"):
        golden_rtmrs(odd, fake_disk(tmp_path / "disk.raw"))
