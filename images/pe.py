"""The few PE/COFF facts the boot chain needs, parsed without a PE library.

`authenticode_digest` is the hash UEFI firmware logs when it loads an EFI application
(EV_EFI_BOOT_SERVICES_APPLICATION: a TDX firmware extends it into RTMR1, a TPM firmware into
PCR 4). It is the PE's Authenticode hash (Microsoft PE/COFF spec, "Calculating the PE Image
Hash"): the headers without the checksum field and the certificate-table directory entry, then
the sections' raw data in file order, then any trailing bytes except the certificate table. It is
not the file's SHA-256, although for an unsigned image both cover every byte but those 12.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass


class PeError(Exception):
    pass


@dataclass(frozen=True)
class PeLayout:
    image_base: int
    size_of_image: int
    section_alignment: int
    checksum_offset: int
    cert_dir_offset: int  # the certificate table's data-directory entry (8 bytes)
    cert_table: tuple[int, int]  # file offset, size (0, 0: unsigned)
    size_of_headers: int
    sections: tuple[tuple[int, int], ...]  # (PointerToRawData, SizeOfRawData)


def parse(data: bytes) -> PeLayout:
    if data[:2] != b"MZ" or len(data) < 0x40:
        raise PeError("not a PE image: no MZ header")
    (pe,) = struct.unpack_from("<I", data, 0x3C)
    if data[pe : pe + 4] != b"PE\0\0":
        raise PeError("not a PE image: no PE signature")
    nsections, opt_size = struct.unpack_from("<H12xH", data, pe + 6)
    opt = pe + 24
    (magic,) = struct.unpack_from("<H", data, opt)
    if magic != 0x20B:
        raise PeError(f"not a PE32+ image (optional header magic {magic:#x})")
    (image_base,) = struct.unpack_from("<Q", data, opt + 24)
    (section_alignment,) = struct.unpack_from("<I", data, opt + 32)
    size_of_image, size_of_headers = struct.unpack_from("<II", data, opt + 56)
    (ndirs,) = struct.unpack_from("<I", data, opt + 108)
    cert_dir = opt + 112 + 4 * 8  # data directory 4: the certificate table
    cert = struct.unpack_from("<II", data, cert_dir) if ndirs > 4 else (0, 0)
    table = opt + opt_size
    sections = []
    for i in range(nsections):
        raw_size, raw_ptr = struct.unpack_from("<II", data, table + 40 * i + 16)
        if raw_size:
            if raw_ptr + raw_size > len(data):
                raise PeError(f"section {i} runs past the end of the file")
            sections.append((raw_ptr, raw_size))
    return PeLayout(
        image_base,
        size_of_image,
        section_alignment,
        opt + 64,
        cert_dir if ndirs > 4 else 0,
        (cert[0], cert[1]),
        size_of_headers,
        tuple(sorted(sections)),
    )


@dataclass(frozen=True)
class Section:
    name: str
    virtual_size: int
    raw_ptr: int
    raw_size: int

    def loaded(self, data: bytes) -> bytes:
        """The section as the loader maps it: VirtualSize bytes, zero-filled past its raw data
        (what systemd-stub measures, not the file-aligned raw size)."""
        raw = data[self.raw_ptr : self.raw_ptr + min(self.raw_size, self.virtual_size)]
        return raw + bytes(self.virtual_size - len(raw))


def sections(data: bytes) -> list[Section]:
    """The section table in header order (names are the 8-byte short names, NULs stripped)."""
    parse(data)  # the same checks as every other reader
    (pe,) = struct.unpack_from("<I", data, 0x3C)
    nsections, opt_size = struct.unpack_from("<H12xH", data, pe + 6)
    table = pe + 24 + opt_size
    out = []
    for i in range(nsections):
        raw_name, vsize, _va, raw_size, raw_ptr = struct.unpack_from(
            "<8sIIII", data, table + 40 * i
        )
        name = raw_name.rstrip(b"\0").decode("ascii", "replace")
        out.append(Section(name, vsize, raw_ptr, raw_size))
    return out


def pe_checksum(data: bytes, checksum_offset: int) -> int:
    """The optional header's CheckSum (imagehlp's algorithm: 16-bit one's-complement-style sum
    of the file without the field, plus the file length)."""
    body = data[:checksum_offset] + bytes(4) + data[checksum_offset + 4 :]
    if len(body) % 2:
        body += b"\0"
    total: int = sum(memoryview(body).cast("H"))  # little-endian words (x86-64 only)
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return (total + len(data)) & 0xFFFFFFFF


def with_timestamp(data: bytes, timestamp: int) -> bytes:
    """The image with the COFF header's TimeDateStamp set, and its CheckSum recomputed."""
    layout = parse(data)
    (pe,) = struct.unpack_from("<I", data, 0x3C)
    out = bytearray(data)
    struct.pack_into("<I", out, pe + 8, timestamp)
    struct.pack_into(
        "<I", out, layout.checksum_offset, pe_checksum(bytes(out), layout.checksum_offset)
    )
    return bytes(out)


def authenticode_digest(data: bytes, algorithm: str = "sha384") -> str:
    pe = parse(data)
    h = hashlib.new(algorithm)
    if pe.cert_dir_offset:
        h.update(data[: pe.checksum_offset])
        h.update(data[pe.checksum_offset + 4 : pe.cert_dir_offset])
        h.update(data[pe.cert_dir_offset + 8 : pe.size_of_headers])
    else:
        h.update(data[: pe.checksum_offset])
        h.update(data[pe.checksum_offset + 4 : pe.size_of_headers])
    hashed = pe.size_of_headers
    for ptr, size in pe.sections:
        h.update(data[ptr : ptr + size])
        hashed += size
    end = len(data) - pe.cert_table[1]
    if end > hashed:
        h.update(data[hashed:end])
    return h.hexdigest()
