"""The one exception family `umbra.attest` raises: callers catch `AttestError` and show its text."""

from __future__ import annotations

from enum import StrEnum


class AttestError(Exception):
    """Base class: every failure in this package is one of these, with a message fit for a user."""


class QuoteParseError(AttestError):
    """A quote is malformed. Carries the field and byte offset where parsing stopped."""

    def __init__(self, message: str, *, field: str, offset: int) -> None:
        super().__init__(f"{message} (field {field!r} at byte {offset})")
        self.field = field
        self.offset = offset


class EventLogError(AttestError):
    """An event log is malformed or does not replay."""


class PolicyFileError(AttestError):
    """A measurement policy file is missing, malformed or violates the schema."""


class CollateralError(AttestError):
    """Collateral could not be loaded, fetched or parsed."""


class CollateralRefusal(StrEnum):
    """Why a collateral set was refused: callers count and log by it, people read the text."""

    MISSING = "missing"  # the peer sent none with its quote
    OVERSIZED = "oversized"  # more bytes than any real set (MAX_RELAYED_COLLATERAL)
    MALFORMED = "malformed"  # not a collateral document
    WRONG_FMSPC = "wrong_fmspc"  # TCB info for another platform than the quote's PCK
    STALE = "stale"  # past a nextUpdate (TCB info, QE identity or a CRL), or not yet issued
    TAMPERED = "tampered"  # a signature or issuer chain does not verify up to the pinned root
    REVOKED = "revoked"  # a CRL lists the quote's PCK certificate or its issuing CA


class CollateralRefused(CollateralError):
    """Collateral that is there but unfit: carries the precise `refusal`."""

    def __init__(self, refusal: CollateralRefusal, message: str) -> None:
        super().__init__(f"collateral refused ({refusal}): {message}")
        self.refusal = refusal


class QuoteSourceError(AttestError):
    """A quote could not be obtained from the TEE."""


class ATLSError(AttestError):
    """The attested-TLS exchange failed: protocol, framing or verification."""


class ATLSRefused(ATLSError):
    """The client refused the peer's evidence; `collateral_refusal` says why when collateral
    was the cause (a forwarder counts and logs by it)."""

    def __init__(self, message: str, collateral_refusal: CollateralRefusal | None = None) -> None:
        super().__init__(message)
        self.collateral_refusal = collateral_refusal


class EvidenceFormatError(AttestError):
    """Input handed over as evidence is neither a binary quote nor hex or base64 of one."""
