"""A simulated TDX guest: measurement registers, runtime events, and quotes in the real format.

Quotes are laid out byte for byte like Intel's (v4 with TD report 1.0, or v5 with TD report
1.5), signed by an attestation key whose QE report is signed by the simulated PCK key.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric import ec

from umbra.attest.errors import AttestError
from umbra.attest.eventlog import (
    EV_EFI_ACTION,
    EV_SEPARATOR,
    RUNTIME_EVENT_TYPE,
    Event,
    make_event,
    make_runtime_event,
    replay,
)
from umbra.attest.measurement import ReleaseManifest
from umbra.attest.quote import ATT_KEY_ECDSA_P256, BODY_TYPE_TD15, TEE_TYPE_TDX
from umbra.attest.simpki import (
    QE_ATTRIBUTES,
    QE_ISVPRODID,
    QE_ISVSVN,
    QE_MRSIGNER,
    SIM_CPUSVN,
    SIM_PCESVN,
    SIM_TEE_TCB_SVN,
    SimulatedPki,
    raw_public_key,
    raw_signature,
)

INTEL_QE_VENDOR_ID = bytes.fromhex("939a7233f79c4ca9940a0db3957f0607")
SIM_TD_ATTRIBUTES = 1 << 28  # SEPT_VE_DISABLE, as typical production TDs
SIM_XFAM = 0x00000000000602E7


def _h(label: str, image: str) -> bytes:
    return hashlib.sha384(f"umbra-simulated:{label}:{image}".encode()).digest()


def boot_events(image: str) -> list[Event]:
    """Deterministic stand-ins for firmware, kernel and initrd measurements of `image`."""
    out = []
    for imr, what in ((0, "firmware"), (1, "kernel"), (2, "initrd")):
        out.append(make_event(imr, EV_EFI_ACTION, "", f"{what}:{image}".encode(), b""))
        out.append(make_event(imr, EV_SEPARATOR, "", b"\0\0\0\0", b""))
    return out


def simulated_boot_values(image: str) -> dict[str, list[str]]:
    """Golden MRTD and RTMR0-2 of a simulated image: they depend on its name only, not on a PKI."""
    r = replay(boot_events(image))
    return {
        "mrtd": [_h("mrtd", image).hex()],
        "rtmr0": [r[0].hex()],
        "rtmr1": [r[1].hex()],
        "rtmr2": [r[2].hex()],
    }


@dataclass
class SimulatedTdx:
    """One simulated TD. Thread-safe: quotes and extensions may come from several threads."""

    pki: SimulatedPki
    image: str = "umbra-dev-cvm"
    version: int = 4  # 4: TD report 1.0; 5: TD report 1.5
    debug: bool = False
    td_attributes: int = SIM_TD_ATTRIBUTES
    xfam: int = SIM_XFAM
    events: list[Event] = field(default_factory=list)
    _att_key: ec.EllipticCurvePrivateKey = field(
        default_factory=lambda: ec.generate_private_key(ec.SECP256R1())
    )
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.version not in (4, 5):
            raise AttestError("simulated quote version must be 4 or 5")
        if not self.events:
            self.events = boot_events(self.image)

    @property
    def mr_td(self) -> bytes:
        return bytes.fromhex(simulated_boot_values(self.image)["mrtd"][0])

    @property
    def mr_seam(self) -> bytes:
        return _h("mrseam", "tdx-module")

    def extend_runtime_event(self, name: str, payload: bytes, imr: int = 3) -> Event:
        """What a guest agent does at launch: log the event and extend its digest."""
        ev = make_runtime_event(imr, name, payload)
        with self._lock:
            self.events.append(ev)
        return ev

    def extend_digest(self, digest: bytes, imr: int = 3) -> None:
        """What the RTMR sysfs file does: extend a digest, with no name or payload logged (the
        guest's own event log says them)."""
        if imr != 3 or len(digest) != 48:
            raise AttestError("only RTMR3 is extended at runtime, by a 48-byte SHA-384 digest")
        with self._lock:
            self.events.append(Event(imr, RUNTIME_EVENT_TYPE, digest, "", b"", False))

    def event_log(self) -> list[Event]:
        with self._lock:
            return list(self.events)

    def rtmrs(self) -> tuple[bytes, bytes, bytes, bytes]:
        return replay(self.event_log())

    def release_manifest(self, name: str | None = None, **extra: object) -> ReleaseManifest:
        """The golden values an image pipeline would publish for this simulated image."""
        return ReleaseManifest.model_validate(
            {
                "apiVersion": "umbra/v1",
                "kind": "ReleaseManifest",
                "name": name or self.image,
                "tee": "simulated",
                **simulated_boot_values(self.image),
                **extra,
            }
        )

    def quote(self, report_data: bytes) -> bytes:
        if len(report_data) > 64:
            raise AttestError("report_data is at most 64 bytes")
        rd = report_data.ljust(64, b"\0")
        attrs = self.td_attributes | (1 if self.debug else 0)
        rtmrs = self.rtmrs()
        body = (
            SIM_TEE_TCB_SVN
            + self.mr_seam
            + bytes(48)  # mr_signer_seam: Intel's module is signed by an all-zero MRSIGNER
            + bytes(8)  # seam_attributes
            + attrs.to_bytes(8, "little")
            + self.xfam.to_bytes(8, "little")
            + self.mr_td
            + bytes(48 * 3)  # mr_config_id, mr_owner, mr_owner_config
            + b"".join(rtmrs)
            + rd
        )
        header = struct.pack(
            "<HHIHH", self.version, ATT_KEY_ECDSA_P256, TEE_TYPE_TDX, 0, SIM_PCESVN
        )
        header += INTEL_QE_VENDOR_ID + bytes(20)
        if self.version == 5:
            body += SIM_TEE_TCB_SVN + bytes(48)  # tee_tcb_svn2, mr_service_td
            signed = header + struct.pack("<HI", BODY_TYPE_TD15, len(body)) + body
        else:
            signed = header + body
        return signed + self._signature_data(signed)

    def _signature_data(self, signed: bytes) -> bytes:
        att_pub = raw_public_key(self._att_key)
        auth = bytes(range(32))
        qe_report = (
            SIM_CPUSVN
            + struct.pack("<I", 0)
            + bytes(28)
            + QE_ATTRIBUTES
            + hashlib.sha256(b"umbra-simulated-qe").digest()
            + bytes(32)
            + QE_MRSIGNER
            + bytes(96)
            + struct.pack("<HH", QE_ISVPRODID, QE_ISVSVN)
            + bytes(60)
            + hashlib.sha256(att_pub + auth).digest()
            + bytes(32)
        )
        chain = self.pki.pck_chain_pem() + b"\0"
        inner = struct.pack("<HI", 5, len(chain)) + chain
        cert = (
            qe_report
            + raw_signature(self.pki.pck_key, qe_report)
            + struct.pack("<H", len(auth))
            + auth
            + inner
        )
        sig = (
            raw_signature(self._att_key, signed) + att_pub + struct.pack("<HI", 6, len(cert)) + cert
        )
        return struct.pack("<I", len(sig)) + sig
