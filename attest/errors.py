"""The one exception family `umbra.attest` raises: callers catch `AttestError` and show its text."""

from __future__ import annotations


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


class QuoteSourceError(AttestError):
    """A quote could not be obtained from the TEE."""


class ATLSError(AttestError):
    """The attested-TLS exchange failed: protocol, framing or verification."""


class EvidenceFormatError(AttestError):
    """Input handed over as evidence is neither a binary quote nor hex or base64 of one."""
