"""The one mapping of the services' domain errors to HTTP: the API answers `{"detail": ...}` with
the status below (as an `HTTPException` would), and the web view renders the same status and
message as its error page."""

from __future__ import annotations

from fastapi import FastAPI, Request, status
from fastapi.responses import JSONResponse

from umbra.console.services.errors import (
    Conflict,
    DatabaseUnavailable,
    Forbidden,
    Invalid,
    NotFound,
    ProviderFailed,
    RateLimited,
    ServiceError,
    Stale,
    Unavailable,
)

STATUS: dict[type[ServiceError], int] = {
    NotFound: status.HTTP_404_NOT_FOUND,
    Forbidden: status.HTTP_403_FORBIDDEN,
    Conflict: status.HTTP_409_CONFLICT,
    Invalid: status.HTTP_422_UNPROCESSABLE_CONTENT,
    Stale: status.HTTP_412_PRECONDITION_FAILED,
    Unavailable: status.HTTP_503_SERVICE_UNAVAILABLE,
    ProviderFailed: status.HTTP_502_BAD_GATEWAY,
    RateLimited: status.HTTP_429_TOO_MANY_REQUESTS,
}


def status_of(exc: ServiceError) -> int:
    for kind in type(exc).__mro__:
        if kind in STATUS:
            return STATUS[kind]
    return status.HTTP_500_INTERNAL_SERVER_ERROR


def install(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_request: Request, exc: ServiceError) -> JSONResponse:
        headers = None
        if isinstance(exc, DatabaseUnavailable):
            headers = {"Retry-After": "5"}
        elif isinstance(exc, RateLimited):
            headers = {"Retry-After": str(exc.retry_after)}
        return JSONResponse({"detail": exc.detail}, status_code=status_of(exc), headers=headers)
