"""The collateral's own signatures and CRLs, checked up to the pinned root before DCAP runs.

dcap-qvl checks TCB info, QE identity and the CRLs as part of verifying a quote, but its texts
do not say which part failed (a tampered TCB info and a bad PCK chain read alike), and it never
reads `pck_crl_issuer_chain`, so a changed byte there would pass. Collateral may come from an
untrusted relay (the attested peer itself, atls.py), so every part is checked here, against the
root the verifier pins (Intel's, or the simulated root when simulated quotes are allowed), with a
precise `CollateralRefusal`. PCCS and file collateral get exactly the same checks.

Encodings must be canonical (PEM as the certificates re-encode, lower-case hex, as Intel's PCS
and dcap-qvl write them): otherwise a changed byte that decodes to the same certificate or
signature (a form feed for a newline, `A` for `a`) would pass unnoticed.
"""

from __future__ import annotations

import hashlib
import itertools
import warnings

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding

from umbra.attest.collateral import Collateral
from umbra.attest.errors import CollateralRefusal, CollateralRefused

_TAMPERED = CollateralRefusal.TAMPERED
# Everything cryptography raises on hostile certificates, CRLs and signatures.
_BAD = (
    ValueError,
    TypeError,
    IndexError,
    InvalidSignature,
    UnsupportedAlgorithm,
    x509.InvalidVersion,
)


def _chain(doc: dict[str, str], field: str, root_der: bytes) -> list[x509.Certificate]:
    """The issuer chain in `field`, each certificate issued by the next, ending in the root."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # hostile input may trip deprecation warnings
            certs = x509.load_pem_x509_certificates(doc[field].encode())
        if "".join(c.public_bytes(Encoding.PEM).decode() for c in certs) != doc[field]:
            raise CollateralRefused(_TAMPERED, f"{field} is not canonical PEM")
        if certs[-1].public_bytes(Encoding.DER) != root_der:
            raise CollateralRefused(_TAMPERED, f"{field} does not end in the pinned root CA")
        for cert, issuer in itertools.pairwise(certs):
            _strict_signature_bits(cert.public_bytes(Encoding.DER))
            cert.verify_directly_issued_by(issuer)
    except _BAD:
        raise CollateralRefused(_TAMPERED, f"{field} is not a valid chain to the root") from None
    return certs


def _tlv(der: bytes, at: int) -> tuple[int, int, int]:
    """(tag, start of content, end of content) of the DER element at `at`."""
    tag, first = der[at], der[at + 1]
    if first < 0x80:
        return tag, at + 2, at + 2 + first
    count = first & 0x7F
    length = int.from_bytes(der[at + 2 : at + 2 + count])
    return tag, at + 2 + count, at + 2 + count + length


def _strict_signature_bits(der: bytes) -> None:
    """The certificate's signature BIT STRING declares no unused bits: cryptography ignores that
    byte, so a changed one would otherwise decode to the same, validly signed certificate."""
    _, body, _ = _tlv(der, 0)  # Certificate ::= SEQUENCE { tbs, algorithm, signature }
    _, _, after_tbs = _tlv(der, body)
    _, _, after_alg = _tlv(der, after_tbs)
    tag, content, _ = _tlv(der, after_alg)
    if tag != 0x03 or der[content] != 0:
        raise ValueError("the signature BIT STRING declares unused bits")


def _hex(doc: dict[str, str], field: str) -> bytes:
    raw = bytes.fromhex(doc[field])
    if raw.hex() != doc[field]:
        raise ValueError("not canonical lower-case hex")
    return raw


def _signed(doc: dict[str, str], field: str, signer: x509.Certificate) -> None:
    """`field`'s text carries a raw P-256 r ‖ s signature by `signer` in `field`_signature."""
    try:
        raw = _hex(doc, f"{field}_signature")
        if len(raw) != 64:
            raise ValueError("not 64 bytes")
        key = signer.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise TypeError("not an EC key")
        der = encode_dss_signature(int.from_bytes(raw[:32]), int.from_bytes(raw[32:]))
        key.verify(der, doc[field].encode(), ec.ECDSA(hashes.SHA256()))
    except _BAD:
        raise CollateralRefused(_TAMPERED, f"the {field} signature does not verify") from None


def _crl(
    doc: dict[str, str], field: str, issuer: x509.Certificate
) -> x509.CertificateRevocationList:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            crl = x509.load_der_x509_crl(_hex(doc, field))
            key = issuer.public_key()
            valid = crl.issuer == issuer.subject and crl.is_signature_valid(key)  # type: ignore[arg-type]
    except _BAD:
        valid = False
    if not valid:
        raise CollateralRefused(_TAMPERED, f"{field} is not signed by its issuer")
    return crl


def _revoked(
    crl: x509.CertificateRevocationList, cert: x509.Certificate, what: str, field: str
) -> None:
    if crl.get_revoked_certificate_by_serial_number(cert.serial_number) is not None:
        raise CollateralRefused(
            CollateralRefusal.REVOKED, f"{field} revokes the {what} (serial {cert.serial_number:x})"
        )


_MEMO: dict[bytes, CollateralRefused | None] = {}
_MEMO_ENTRIES = 64


def check_collateral(collateral: Collateral, pck_chain_pem: bytes, root_der: bytes) -> None:
    """Raise `CollateralRefused` unless every signature of the set verifies up to `root_der`
    and neither CRL revokes a certificate of the quote's PCK chain or the TCB signing cert.

    The answer is kept per (set, PCK chain, root) bytes: a platform's quotes all carry one
    chain, so a verifier checks each set once (about 1 ms of ECDSA), not per handshake."""
    key = hashlib.sha256(
        b"\0".join((collateral.json_text.encode(), pck_chain_pem, root_der))
    ).digest()
    if key not in _MEMO:
        try:
            _check(collateral, _pck_chain(pck_chain_pem), root_der)
            outcome: CollateralRefused | None = None
        except CollateralRefused as exc:
            outcome = exc
        if len(_MEMO) >= _MEMO_ENTRIES:
            _MEMO.clear()  # bounded: hostile sets cannot grow it
        _MEMO[key] = outcome
    refused = _MEMO[key]
    if refused is not None:
        raise CollateralRefused(refused.refusal, str(refused).partition("): ")[2])


def _pck_chain(pem: bytes) -> list[x509.Certificate]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return x509.load_pem_x509_certificates(pem.rstrip(b"\0"))
    except _BAD:
        return []  # the quote's own chain is refused by DCAP, under its own step


def _check(collateral: Collateral, pck_chain: list[x509.Certificate], root_der: bytes) -> None:
    doc = collateral.document
    root = x509.load_der_x509_certificate(root_der)
    tcb_chain = _chain(doc, "tcb_info_issuer_chain", root_der)
    qe_chain = _chain(doc, "qe_identity_issuer_chain", root_der)
    crl_chain = _chain(doc, "pck_crl_issuer_chain", root_der)
    _signed(doc, "tcb_info", tcb_chain[0])
    _signed(doc, "qe_identity", qe_chain[0])
    root_crl = _crl(doc, "root_ca_crl", root)
    pck_crl = _crl(doc, "pck_crl", crl_chain[0])
    if len(pck_chain) < 2:
        return  # the quote's own chain is refused by DCAP, under its own step
    leaf, issuing_ca = pck_chain[0], pck_chain[1]
    if crl_chain[0].public_bytes(Encoding.DER) != issuing_ca.public_bytes(Encoding.DER):
        raise CollateralRefused(
            _TAMPERED, "pck_crl_issuer_chain does not start with the quote's PCK issuing CA"
        )
    if issuing_ca.subject != pck_crl.issuer:
        raise CollateralRefused(
            _TAMPERED, "pck_crl is not the CRL of the CA that issued the quote's PCK certificate"
        )
    _revoked(pck_crl, leaf, "quote's PCK certificate", "pck_crl")
    _revoked(root_crl, issuing_ca, "quote's PCK issuing CA", "root_ca_crl")
    _revoked(root_crl, tcb_chain[0], "TCB signing certificate", "root_ca_crl")
