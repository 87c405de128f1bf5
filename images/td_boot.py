"""Golden RTMR1 and RTMR2 of a TD that boots our disk, computed from the built image alone.

A TD's firmware (TDVF, edk2's OvmfPkg/Tcg/TdTcg2Dxe) measures the boot path as a TPM firmware
would, through the CC measurement protocol, and maps the TCG PCRs onto the TD's registers
(UEFI 2.10 §38.4.1): PCR 1 and 7 → RTMR0, PCR 2-6 → RTMR1, PCR 8-15 → RTMR2 (PCR 0 is MRTD,
which nothing extends). The events that depend on our image, in the order they are extended:

- RTMR1 (TDVF, first ReadyToBoot): EV_EFI_ACTION "Calling EFI Application from Boot Option"
  (PCR 4), one EV_SEPARATOR (TDVF draws it once into RTMR1; a TPM firmware once per PCR 0-6);
  then, when the firmware loads BOOTX64.EFI from the disk, EV_EFI_GPT_EVENT (PCR 5: the primary
  GPT header and the used partition entries, UEFI_GPT_DATA) and EV_EFI_BOOT_SERVICES_APPLICATION
  (PCR 4: the UKI's Authenticode hash, images.pe); last, at ExitBootServices, the two EV_EFI_ACTION
  events "Exit Boot Services Invocation" and "… Returned with Success" (PCR 5).
- RTMR2: systemd-stub measures each UKI section it knows (PCR 11, EV_IPL, canonical UKI order),
  twice: its name (ASCII with the NUL) and its loaded contents; then the kernel's EFI stub
  measures what it was handed (PCR 9, EV_EVENT_TAG): the load options (the command line as
  UTF-16 with its NUL, as systemd-stub sets them) and the initrd (the `.initrd` section).

The digests of actions, separators, the GPT and tagged events are hashes of those bytes; the
application's is the Authenticode hash. So one function (`boot_measurements`) gives both a
TPM's SHA-256 bank and a TD's SHA-384 registers: `golden_rtmrs` (a TD's RTMR1/RTMR2, GCP) and
`golden_pcrs` (SHA-256 PCRs 4, 5, 9, 11, 12, what Azure's paravisor measures into its vTPM).
Everything else in RTMR0 (and MRTD), or Azure's PCRs 0-3, 6, 7, is the cloud firmware's:
per-cloud inputs, never computed here.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from umbra.attest.eventlog import EV_EFI_ACTION, EV_SEPARATOR, Event, make_event, replay
from umbra.images.pe import PeError, authenticode_digest, sections

EV_EVENT_TAG = 0x00000006
EV_IPL = 0x0000000D
EV_EFI_BOOT_SERVICES_APPLICATION = 0x80000003
EV_EFI_GPT_EVENT = 0x80000006

CALLING = b"Calling EFI Application from Boot Option"
RETURNING = b"Returning from EFI Application from Boot Option"
EXIT_BOOT_SERVICES = (b"Exit Boot Services Invocation", b"Exit Boot Services Returned with Success")
SEPARATOR = bytes(4)
# Linux's EFI stub (drivers/firmware/efi/libstub): its tagged events into PCR 9.
LOAD_OPTIONS_TAG, LOAD_OPTIONS_DESC = 0x8F3B22ED, b"LOADED_IMAGE::LoadOptions\0"
INITRD_TAG, INITRD_DESC = 0x8F3B22EC, b"Linux initrd\0"
# systemd-stub's measured sections, in the UKI specification's canonical order (those our UKI
# can carry; `.pcrsig` is never measured). Any other UKI section is refused: what the stub does
# with it was not checked against a real log.
MEASURED_SECTIONS = (".linux", ".osrel", ".cmdline", ".initrd", ".uname", ".sbat")
UNCHECKED_SECTIONS = frozenset(
    {".ucode", ".splash", ".dtb", ".pcrpkey", ".pcrsig", ".profile", ".dtbauto", ".hwids",
     ".efifw"}
)  # fmt: skip
SECTOR = 512
GPT_HEADER_SIZE = 92  # sizeof(EFI_PARTITION_TABLE_HEADER), what edk2 copies into UEFI_GPT_DATA


class TdBootError(Exception):
    """The image cannot be measured (names the file and what is wrong)."""


class Bank(StrEnum):
    sha256 = "sha256"  # a TPM's PCR bank (the software-TPM validation; Azure's vTPM)
    sha384 = "sha384"  # a TD's RTMRs


def rtmr_of_pcr(pcr: int) -> int:
    """TDVF's MapPcrToMrIndex, as an RTMR index (0-2)."""
    if pcr in (1, 7):
        return 0
    if 2 <= pcr <= 6:
        return 1
    if 8 <= pcr <= 15:
        return 2
    raise TdBootError(f"PCR {pcr} has no RTMR (PCR 0 is MRTD, which is never extended)")


@dataclass(frozen=True)
class Measured:
    """One measurement: where a TPM firmware puts it, its type, what it is, its digests, and
    the event data a log carries for it (fixed bytes; b"" where it names memory addresses)."""

    pcr: int
    event_type: int
    label: str
    sha256: bytes
    sha384: bytes
    event_data: bytes

    def digest(self, bank: Bank) -> bytes:
        return self.sha256 if bank is Bank.sha256 else self.sha384

    @property
    def rtmr(self) -> int:
        return rtmr_of_pcr(self.pcr)


def _hashed(pcr: int, event_type: int, label: str, data: bytes, event_data: bytes) -> Measured:
    return Measured(
        pcr,
        event_type,
        label,
        hashlib.sha256(data).digest(),
        hashlib.sha384(data).digest(),
        event_data,
    )


def _action(pcr: int, text: bytes) -> Measured:
    return _hashed(pcr, EV_EFI_ACTION, text.decode(), text, text)


def _separator(pcr: int) -> Measured:
    return _hashed(pcr, EV_SEPARATOR, "separator", SEPARATOR, SEPARATOR)


def _tagged(pcr: int, tag: int, desc: bytes, data: bytes) -> Measured:
    event = struct.pack("<II", tag, len(desc)) + desc
    return _hashed(pcr, EV_EVENT_TAG, desc.rstrip(b"\0").decode(), data, event)


def gpt_event_data(head: bytes, source: str = "disk") -> bytes:
    """UEFI_GPT_DATA of a disk (its first sectors): the primary header, the count of used
    entries as a UINT64, then those entries (non-zero type GUID) in table order."""
    header = head[SECTOR : SECTOR + GPT_HEADER_SIZE]
    if header[:8] != b"EFI PART":
        raise TdBootError(f"{source}: no GPT header at LBA 1")
    (entries_lba,) = struct.unpack_from("<Q", header, 72)
    count, entry_size = struct.unpack_from("<II", header, 80)
    start = entries_lba * SECTOR
    table = head[start : start + count * entry_size]
    if len(table) != count * entry_size or entry_size < 128:
        raise TdBootError(f"{source}: GPT partition entries are truncated or malformed")
    entries = [table[i : i + entry_size] for i in range(0, len(table), entry_size)]
    used = [e for e in entries if e[:16] != bytes(16)]
    return header + struct.pack("<Q", len(used)) + b"".join(used)


def _sections(uki: bytes, source: str) -> dict[str, bytes]:
    try:
        table = sections(uki)
    except PeError as exc:
        raise TdBootError(f"{source}: {exc}") from None
    found = {s.name: s for s in table}
    unchecked = sorted(set(found) & UNCHECKED_SECTIONS)
    if unchecked:
        raise TdBootError(
            f"{source}: UKI section(s) {', '.join(unchecked)}: systemd-stub's measurement of "
            "them was never checked against a real event log, so no golden value is computed"
        )
    for need in (".linux", ".cmdline", ".initrd"):
        if need not in found:
            raise TdBootError(f"{source}: not a UKI of ours: no {need} section")
    return {name: found[name].loaded(uki) for name in MEASURED_SECTIONS if name in found}


def _utf16(text: str) -> bytes:
    return text.encode("utf-16-le")


def _pad4(data: bytes) -> bytes:
    return data + bytes(-len(data) % 4)


def _cpio_entry(inode: int, mode: int, size: int, name: bytes) -> bytes:
    fields = (inode, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, len(name) + 1, 0)
    return _pad4(b"070701" + b"".join(b"%08x" % f for f in fields) + name + b"\0")


# systemd's literal trailer (nlink 1, an upper-case name size): bytes as the stub writes them.
CPIO_TRAILER = (
    b"070701" + b"00000000" * 4 + b"00000001" + b"00000000" * 6 + b"0000000B" + b"00000000"
    + b"TRAILER!!!\0\0\0\0"
)  # fmt: skip


def extra_cpio(filename: bytes, data: bytes) -> bytes:
    """systemd-stub's pack_cpio_literal into `.extra` (newc, mtime 0, inodes from 1): how 257
    hands the UKI's `.osrel` to the initrd as /.extra/os-release."""
    return (
        _cpio_entry(1, 0o040555, 0, b".extra")
        + _cpio_entry(2, 0o100444, len(data), b".extra/" + filename)
        + _pad4(data)
        + CPIO_TRAILER
    )


def kernel_initrd(loaded: dict[str, bytes]) -> bytes:
    """The initrd systemd-stub hands the kernel (combine_initrds): its initrds in the stub's
    order, each padded to 4 bytes: the `.initrd` section, then (257) `.osrel` as a cpio."""
    out = _pad4(loaded[".initrd"])
    if ".osrel" in loaded:
        out += extra_cpio(b"os-release", loaded[".osrel"])
    return out


def boot_measurements(
    uki: bytes, gpt: bytes, source: str = "UKI", returned_attempts: int = 0
) -> list[Measured]:
    """The image-dependent measurements of one boot of our disk, in extend order (a TD's; a TPM
    firmware adds one separator per PCR 0-6 where the TD has one, see `tpm_separators`).
    `returned_attempts`: boot options the firmware tried, and came back from, before ours
    (each logs "Returning from…" then "Calling…" again); none on the clouds."""
    loaded = _sections(uki, source)
    stub: list[Measured] = []
    for name, contents in loaded.items():
        desc = _utf16(name + "\0")
        stub.append(_hashed(11, EV_IPL, f"{name} (name)", name.encode() + b"\0", desc))
        stub.append(_hashed(11, EV_IPL, f"{name} (contents)", contents, desc))
    raw_cmdline = loaded[".cmdline"]
    if not raw_cmdline.isascii() or any(c < 0x20 for c in raw_cmdline.rstrip(b" \n")):
        # systemd-stub rewrites control characters (mangle_stub_cmdline); ours has none, and a
        # rewrite that was never checked against a log is not predicted.
        raise TdBootError(f"{source}: .cmdline is not printable ASCII")
    cmdline = raw_cmdline.decode().rstrip()
    app = Measured(
        4,
        EV_EFI_BOOT_SERVICES_APPLICATION,
        "UKI (Authenticode)",
        bytes.fromhex(authenticode_digest(uki, "sha256")),
        bytes.fromhex(authenticode_digest(uki, "sha384")),
        b"",  # EFI_IMAGE_LOAD_EVENT: load address and device path, not in the digest
    )
    retries = [_action(4, text) for _ in range(returned_attempts) for text in (RETURNING, CALLING)]
    return [
        _action(4, CALLING),
        _separator(4),
        *retries,
        _hashed(5, EV_EFI_GPT_EVENT, "GPT", gpt, gpt),
        app,
        *stub,
        _tagged(9, LOAD_OPTIONS_TAG, LOAD_OPTIONS_DESC, _utf16(cmdline + "\0")),
        _tagged(9, INITRD_TAG, INITRD_DESC, kernel_initrd(loaded)),
        *(_action(5, text) for text in EXIT_BOOT_SERVICES),
    ]


def tpm_separators() -> list[Measured]:
    """A TPM firmware's separators on the PCRs the UKI's events share (4 and 5), where TDVF
    extends one into RTMR1."""
    return [_separator(4), _separator(5)]


def tpm_measurements(measured: Sequence[Measured]) -> list[Measured]:
    """The measurements as a TPM firmware extends them: the TD's one separator (second, after
    the first "Calling…") is one on PCR 4 and one on PCR 5 (the order the swtpm log showed)."""
    first, separator, *rest = measured
    if separator.event_type != EV_SEPARATOR:
        raise TdBootError("not a boot_measurements list: no separator after the first event")
    return [first, *tpm_separators(), *rest]


# The SHA-256 PCRs our UKI and disk alone determine: 4 (boot application), 5 (GPT, exit boot
# services), 9 (kernel EFI stub), 11 (systemd-stub's sections) and 12, which nothing extends on
# our boot (systemd-stub measures loader command lines, credentials and add-ons there; we have
# none, so a host that adds one changes it). Each was checked against the swtpm boot's TPM.
TPM_PCRS = (4, 5, 9, 11, 12)


def tpm_pcrs(measured: Sequence[Measured]) -> dict[int, bytes]:
    """TPM_PCRS' SHA-256 values after a boot that extends exactly `measured` (TPM order)."""
    pcrs = dict.fromkeys(TPM_PCRS, bytes(32))
    for m in measured:
        if m.pcr not in pcrs:
            raise TdBootError(f"PCR {m.pcr} is not one of the image's PCRs {TPM_PCRS}")
        pcrs[m.pcr] = hashlib.sha256(pcrs[m.pcr] + m.sha256).digest()
    return pcrs


def td_events(measured: Sequence[Measured]) -> list[Event]:
    """The measurements as the TD's event log holds them (attest's events, SHA-384)."""
    return [
        make_event(m.rtmr, m.event_type, "", m.event_data, m.sha384)
        if m.event_type not in (EV_EFI_ACTION, EV_SEPARATOR)
        else make_event(m.rtmr, m.event_type, "", m.event_data, b"")
        for m in measured
    ]


@dataclass(frozen=True)
class TdBootGolden:
    rtmr1: bytes
    rtmr2: bytes
    measured: tuple[Measured, ...]

    def events(self) -> list[Event]:
        return td_events(self.measured)


@dataclass(frozen=True)
class TpmBootGolden:
    """The image's SHA-256 PCRs (TPM_PCRS) and the events they replay, in TPM order."""

    pcrs: dict[int, bytes]
    measured: tuple[Measured, ...]


def measure_files(uki_path: Path, disk_path: Path, returned_attempts: int = 0) -> list[Measured]:
    """boot_measurements of the UKI at `uki_path` on `disk_path` (its GPT is read from it).
    Raises TdBootError naming the file."""
    try:
        uki = uki_path.read_bytes()
        with disk_path.open("rb") as f:
            head = f.read(1 << 20)  # LBA 0-2047: the primary header and entries live there
    except OSError as exc:
        raise TdBootError(f"{exc.filename}: cannot read: {exc.strerror}") from None
    gpt = gpt_event_data(head, str(disk_path))
    return boot_measurements(uki, gpt, str(uki_path), returned_attempts)


def golden_rtmrs(uki_path: Path, disk_path: Path, returned_attempts: int = 0) -> TdBootGolden:
    """RTMR1 and RTMR2 of a TD booting `disk_path` whose ESP holds `uki_path`."""
    measured = measure_files(uki_path, disk_path, returned_attempts)
    r = replay(td_events(measured))
    return TdBootGolden(r[1], r[2], tuple(measured))


def golden_pcrs(uki_path: Path, disk_path: Path, returned_attempts: int = 0) -> TpmBootGolden:
    """The SHA-256 PCRs (TPM_PCRS) of a TPM firmware booting the same disk: what Azure's vTPM
    is to hold for the image (its paravisor measures the guest's boot there, not in RTMRs)."""
    measured = tpm_measurements(measure_files(uki_path, disk_path, returned_attempts))
    return TpmBootGolden(tpm_pcrs(measured), tuple(measured))
