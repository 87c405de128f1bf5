"""A mock Intel-style DCAP PKI for the simulated TEE: root CA, PCK chain, TCB info, QE identity.

Same formats and algorithms as Intel's (ECDSA P-256, X.509 with the SGX extension, signed JSON
collateral), so dcap-qvl verifies simulated quotes with the production code path; only the root
CA differs. Every subject carries O=SIMULATED so a simulated chain is never mistaken for Intel's.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    load_pem_private_key,
)
from cryptography.x509.oid import NameOID

from umbra.attest.collateral import Collateral
from umbra.attest.errors import AttestError

SGX_EXT_OID = "1.2.840.113741.1.13.1"
SIM_FMSPC = bytes.fromhex("50C06F000000")
SIM_PCE_ID = b"\x00\x00"
SIM_PCESVN = 11
SIM_CPUSVN = bytes([3, 3, 2, 2, 4, 1, 0, 5] + [0] * 8)
# TDX module major version 0 in byte 1, so TCB matching compares all 16 components directly.
SIM_TEE_TCB_SVN = bytes([5, 0, 2] + [0] * 13)
QE_MRSIGNER = bytes.fromhex("dc9e2a7c6f948f17474e34a7fc43ed030f7c1563f1babddf6340c82e0e54a8c5")
QE_ISVPRODID = 2
QE_ISVSVN = 6
QE_ATTRIBUTES = bytes.fromhex("1500000000000000e700000000000000")
VALIDITY_DAYS = 30


def raw_signature(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    """ECDSA-P256/SHA-256 as Intel encodes it: r ‖ s, 32 bytes each."""
    r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def raw_public_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    nums = key.public_key().public_numbers()
    return nums.x.to_bytes(32, "big") + nums.y.to_bytes(32, "big")


# --- a minimal DER writer for the SGX extension (cryptography has no generic ASN.1 encoder) ---
def _tlv(tag: int, body: bytes) -> bytes:
    n = len(body)
    if n < 0x80:
        length = bytes([n])
    else:
        raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
        length = bytes([0x80 | len(raw)]) + raw
    return bytes([tag]) + length + body


def _oid(dotted: str) -> bytes:
    parts = [int(p) for p in dotted.split(".")]
    out = bytes([40 * parts[0] + parts[1]])
    for p in parts[2:]:
        chunk = [p & 0x7F]
        p >>= 7
        while p:
            chunk.append(0x80 | (p & 0x7F))
            p >>= 7
        out += bytes(reversed(chunk))
    return _tlv(0x06, out)


def _int(v: int) -> bytes:
    raw = v.to_bytes(max(1, (v.bit_length() + 8) // 8), "big")
    return _tlv(0x02, raw)


def _seq(*items: bytes) -> bytes:
    return _tlv(0x30, b"".join(items))


def _pair(sub: str, value: bytes) -> bytes:
    return _seq(_oid(f"{SGX_EXT_OID}.{sub}"), value)


def sgx_extension(ppid: bytes, platform_instance_id: bytes) -> bytes:
    tcb = [_pair(f"2.{i + 1}", _int(SIM_CPUSVN[i])) for i in range(16)]
    tcb.append(_pair("2.17", _int(SIM_PCESVN)))
    tcb.append(_pair("2.18", _tlv(0x04, SIM_CPUSVN)))
    flag = _tlv(0x01, b"\xff")
    return _seq(
        _pair("1", _tlv(0x04, ppid)),
        _pair("2", _seq(*tcb)),
        _pair("3", _tlv(0x04, SIM_PCE_ID)),
        _pair("4", _tlv(0x04, SIM_FMSPC)),
        _pair("5", _tlv(0x0A, b"\x01")),  # SGX type: Scalable
        _pair("6", _tlv(0x04, platform_instance_id)),
        _pair("7", _seq(_pair("7.1", flag), _pair("7.2", flag), _pair("7.3", flag))),
    )


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COUNTRY_NAME, "US"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "SIMULATED - Umbra test PKI, not Intel"),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


_EPOCH = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
_END = dt.datetime(2049, 12, 31, 23, 59, 59, tzinfo=dt.UTC)


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool,
    path_length: int | None = None,
    extra: x509.UnrecognizedExtension | None = None,
) -> x509.Certificate:
    pub = key.public_key()
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer.subject if issuer else _name(subject))
        .public_key(pub)
        .serial_number(x509.random_serial_number())
        .not_valid_before(_EPOCH)
        .not_valid_after(_END)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=path_length), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
        .add_extension(
            x509.KeyUsage(
                digital_signature=not ca,
                content_commitment=not ca,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    if extra is not None:
        b = b.add_extension(extra, critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _crl(
    issuer: x509.Certificate,
    key: ec.EllipticCurvePrivateKey,
    at: int,
    revoked: x509.Certificate | None = None,
) -> bytes:
    now = dt.datetime.fromtimestamp(at, dt.UTC)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer.subject)
        .last_update(now)
        .next_update(now + dt.timedelta(days=VALIDITY_DAYS))
        .add_extension(x509.CRLNumber(1), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False
        )
    )
    if revoked is not None:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder()
            .serial_number(revoked.serial_number)
            .revocation_date(now)
            .build()
        )
    return builder.sign(key, hashes.SHA256()).public_bytes(Encoding.DER)


def _pem(*certs: x509.Certificate) -> str:
    return b"".join(c.public_bytes(Encoding.PEM) for c in certs).decode()


def _iso(ts: int) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def cert_der(data: bytes) -> bytes:
    """A (root) certificate given as PEM or DER, as DER: what a verifier pins. ValueError when
    it is neither."""
    pem = data.lstrip().startswith(b"-----")
    cert = x509.load_pem_x509_certificate(data) if pem else x509.load_der_x509_certificate(data)
    return cert.public_bytes(Encoding.DER)


@dataclass
class SimulatedPki:
    root_key: ec.EllipticCurvePrivateKey
    root: x509.Certificate
    platform_ca_key: ec.EllipticCurvePrivateKey
    platform_ca: x509.Certificate
    pck_key: ec.EllipticCurvePrivateKey
    pck: x509.Certificate
    tcb_signing_key: ec.EllipticCurvePrivateKey
    tcb_signing: x509.Certificate

    @classmethod
    def generate(cls) -> SimulatedPki:
        new = ec.generate_private_key  # P-256, as Intel's PKI
        root_key, ca_key, pck_key, tcb_key = (new(ec.SECP256R1()) for _ in range(4))
        root = _cert("Intel SGX Root CA", root_key, None, root_key, ca=True, path_length=1)
        ca = _cert("Intel SGX PCK Platform CA", ca_key, root, root_key, ca=True, path_length=0)
        ext = x509.UnrecognizedExtension(
            x509.ObjectIdentifier(SGX_EXT_OID), sgx_extension(os.urandom(16), os.urandom(16))
        )
        pck = _cert("Intel SGX PCK Certificate", pck_key, ca, ca_key, ca=False, extra=ext)
        tcb = _cert("Intel SGX TCB Signing", tcb_key, root, root_key, ca=False)
        return cls(root_key, root, ca_key, ca, pck_key, pck, tcb_key, tcb)

    @property
    def root_der(self) -> bytes:
        return self.root.public_bytes(Encoding.DER)

    def root_pem(self) -> str:
        return self.root.public_bytes(Encoding.PEM).decode()

    def pck_chain_pem(self) -> bytes:
        return b"".join(
            c.public_bytes(Encoding.PEM) for c in (self.pck, self.platform_ca, self.root)
        )

    def collateral(
        self, issued_at: int, *, tcb_status: str = "UpToDate", revoke_pck: bool = False
    ) -> Collateral:
        """Collateral valid for 30 days from `issued_at`, as a PCCS would serve it;
        `revoke_pck`: its PCK CRL lists this PKI's PCK certificate."""
        nxt = issued_at + VALIDITY_DAYS * 24 * 3600
        tdx_comps = [{"svn": v} for v in SIM_TEE_TCB_SVN]
        sgx_comps = [{"svn": v} for v in SIM_CPUSVN]
        zero48 = "00" * 48
        module = {
            "mrsigner": zero48,
            "attributes": "0000000000000000",
            "attributesMask": "FFFFFFFFFFFFFFFF",
        }
        tcb_info = {
            "id": "TDX",
            "version": 3,
            "issueDate": _iso(issued_at),
            "nextUpdate": _iso(nxt),
            "fmspc": SIM_FMSPC.hex().upper(),
            "pceId": SIM_PCE_ID.hex(),
            "tcbType": 0,
            "tcbEvaluationDataNumber": 17,
            "tdxModule": module,
            "tdxModuleIdentities": [
                {
                    "id": "TDX_01",
                    **module,
                    "tcbLevels": [
                        {
                            "tcb": {"isvsvn": 4},
                            "tcbDate": "2024-03-13T00:00:00Z",
                            "tcbStatus": "UpToDate",
                        }
                    ],
                }
            ],
            "tcbLevels": [
                {
                    "tcb": {
                        "sgxtcbcomponents": sgx_comps,
                        "pcesvn": SIM_PCESVN,
                        "tdxtcbcomponents": tdx_comps,
                    },
                    "tcbDate": "2024-03-13T00:00:00Z",
                    "tcbStatus": tcb_status,
                    **({"advisoryIDs": ["INTEL-SA-00960"]} if tcb_status != "UpToDate" else {}),
                }
            ],
        }
        qe_identity = {
            "id": "TD_QE",
            "version": 2,
            "issueDate": _iso(issued_at),
            "nextUpdate": _iso(nxt),
            "tcbEvaluationDataNumber": 17,
            "miscselect": "00000000",
            "miscselectMask": "FFFFFFFF",
            "attributes": "11000000000000000000000000000000",
            "attributesMask": "FBFFFFFFFFFFFFFF0000000000000000",
            "mrsigner": QE_MRSIGNER.hex().upper(),
            "isvprodid": QE_ISVPRODID,
            "tcbLevels": [
                {"tcb": {"isvsvn": 4}, "tcbDate": "2024-03-13T00:00:00Z", "tcbStatus": "UpToDate"}
            ],
        }
        tcb_text = json.dumps(tcb_info, separators=(",", ":"))
        qe_text = json.dumps(qe_identity, separators=(",", ":"))
        doc = {
            "pck_crl_issuer_chain": _pem(self.platform_ca, self.root),
            "root_ca_crl": _crl(self.root, self.root_key, issued_at).hex(),
            "pck_crl": _crl(
                self.platform_ca, self.platform_ca_key, issued_at, self.pck if revoke_pck else None
            ).hex(),
            "tcb_info_issuer_chain": _pem(self.tcb_signing, self.root),
            "tcb_info": tcb_text,
            "tcb_info_signature": raw_signature(self.tcb_signing_key, tcb_text.encode()).hex(),
            "qe_identity_issuer_chain": _pem(self.tcb_signing, self.root),
            "qe_identity": qe_text,
            "qe_identity_signature": raw_signature(self.tcb_signing_key, qe_text.encode()).hex(),
        }
        return Collateral.from_json(json.dumps(doc))

    # --- persistence: the embedded default's simulator and verifier share one PKI on disk ---
    _FILES = ("root", "platform_ca", "pck", "tcb_signing")

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name in self._FILES:
            cert: x509.Certificate = getattr(self, name)
            key: ec.EllipticCurvePrivateKey = getattr(self, f"{name}_key")
            (directory / f"{name}.pem").write_bytes(cert.public_bytes(Encoding.PEM))
            key_path = directory / f"{name}.key"
            key_path.write_bytes(
                key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
            )
            key_path.chmod(0o600)

    @classmethod
    def load(cls, directory: Path) -> SimulatedPki:
        parts: dict[str, object] = {}
        try:
            for name in cls._FILES:
                parts[name] = x509.load_pem_x509_certificate(
                    (directory / f"{name}.pem").read_bytes()
                )
                key = load_pem_private_key((directory / f"{name}.key").read_bytes(), None)
                if not isinstance(key, ec.EllipticCurvePrivateKey):
                    raise AttestError(f"{directory}/{name}.key is not an EC key")
                parts[name + "_key"] = key
        except (OSError, ValueError) as exc:
            raise AttestError(f"cannot load simulated PKI from {directory}: {exc}") from None
        return cls(**parts)  # type: ignore[arg-type]

    @classmethod
    def load_or_create(cls, directory: Path) -> SimulatedPki:
        if (directory / "root.pem").is_file():
            return cls.load(directory)
        pki = cls.generate()
        pki.save(directory)
        return pki
