"""Domain errors of the Console's services; the message is safe to show (never a secret value).

The one mapping to HTTP status codes is `umbra.console.routes.errors`.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A refusal the caller can act on; `detail` says what and why."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class NotFound(ServiceError):
    """No such thing, or one the caller may not see (the same answer, so ids do not leak)."""


class Forbidden(ServiceError):
    """The caller's role does not allow this."""


class Conflict(ServiceError):
    """The thing's current state does not allow this (destroyed, busy, taken name, ...)."""


class Invalid(ServiceError):
    """The request names something that cannot be (a field's value; the message names it)."""


class Stale(ServiceError):
    """A conditional change whose precondition (a version the caller read) no longer holds."""


class Unavailable(ServiceError):
    """This Console is not configured for it (no key encryption key, ...)."""


class DatabaseUnavailable(Unavailable):
    """The database does not answer (console/db_watchdog.py); answered with Retry-After."""


class RateLimited(ServiceError):
    """Too many of these from this caller just now; answered with Retry-After."""

    def __init__(self, detail: str, *, retry_after: int) -> None:
        super().__init__(detail)
        self.retry_after = retry_after


class ProviderFailed(ServiceError):
    """A synchronous provider call failed."""


def not_found(what: str) -> NotFound:
    return NotFound(f"{what} not found")
