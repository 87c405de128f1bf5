"""The Console's FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as SqlTimeoutError
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from umbra.console import (
    children,
    db,
    notify,
    provisioning,
    refusal_budget,
    traffic_retention,
)
from umbra.console.config import ConfigError, Settings, settings_summary
from umbra.console.envelope import EnvelopeError, LocalKeyring
from umbra.console.export import runner as export_runner
from umbra.console.export import sinks as export_sinks
from umbra.console.limits import BodyLimitMiddleware, limit_for
from umbra.console.oidc import OidcValidator
from umbra.console.providers import ProviderError, build_providers
from umbra.console.release import AttestedReleaseVerifier, SecretReleaseVerifier
from umbra.console.release_config import enrollment_verifiers, verifier_from_settings
from umbra.console.routes import (
    audit,
    bundles,
    cvms,
    enroll,
    login,
    meta,
    people,
    reenroll,
    secret_refresh,
    secrets,
    security_cvm,
    session,
    team_settings,
    traffic,
    usage,
)
from umbra.console.routes import errors as route_errors
from umbra.console.state import Console
from umbra.console.web import mount as mount_web
from umbra.contracts.traffic import TrafficBatch
from umbra.policy.bundle import BundleError, load_public_key

log = logging.getLogger("umbra.console")
API_VERSION = "1.0.0"
RETRY_AFTER_SECONDS = 5


def build_console(
    settings: Settings,
    *,
    release_verifier: SecretReleaseVerifier | None = None,
    stack_factory: Any = None,
) -> Console:
    try:
        keys = [_bundle_key(entry) for entry in settings.bundle_public_keys]
    except BundleError as exc:
        raise ConfigError(f"bundle_public_keys: {exc}") from None
    oidc = None
    if settings.oidc_issuer:
        try:
            oidc = OidcValidator(
                settings.oidc_issuer,
                settings.oidc_audience,
                settings.oidc_algorithms,
                jwks_ttl=settings.oidc_jwks_ttl_seconds,
                min_refresh_interval=settings.oidc_jwks_min_refresh_seconds,
                leeway=settings.oidc_leeway_seconds,
                allow_insecure_http=settings.oidc_allow_insecure_http,
                accept_development_issuer=settings.embedded_dev,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    keyring = None
    if settings.kek:
        try:
            keyring = LocalKeyring.from_config(settings.kek, settings.kek_current)
        except EnvelopeError as exc:
            raise ConfigError(str(exc)) from None
    try:
        providers = build_providers(settings, stack_factory=stack_factory)
    except (ValueError, ProviderError) as exc:
        raise ConfigError(str(exc)) from None
    if release_verifier is None:
        release_verifier = verifier_from_settings(settings)
    security = release_verifier if isinstance(release_verifier, AttestedReleaseVerifier) else None
    verifiers = enrollment_verifiers(settings, security)
    return Console(
        settings=settings,
        engine=db.make_engine(
            settings.database_url,
            statement_timeout_ms=settings.db_statement_timeout_ms,
            connect_timeout_s=settings.db_connect_timeout_seconds,
        ),
        oidc=oidc,
        bundle_keys=keys,
        keyring=keyring,
        providers=providers,
        release_verifier=release_verifier,
        enrollment_verifiers=verifiers,
    )


def _bundle_key(entry: Path | str) -> Ed25519PublicKey:
    """A key setting is PEM text (starts with `-----BEGIN`) or the path of a PEM file."""
    if isinstance(entry, str) and entry.lstrip().startswith("-----BEGIN"):
        try:
            key = serialization.load_pem_public_key(entry.strip().encode())
        except ValueError:
            raise BundleError("PEM text does not parse as a public key") from None
        if not isinstance(key, Ed25519PublicKey):
            raise BundleError("PEM text is not an Ed25519 public key")
        return key
    return load_public_key(Path(entry))


def create_app(
    settings: Settings,
    *,
    release_verifier: SecretReleaseVerifier | None = None,
    stack_factory: Any = None,
    owns_process: bool = False,
) -> FastAPI:
    """`stack_factory` stands in for the Pulumi CLI under the cloud adapters (tests).
    `owns_process`: this process is the Console's alone (`umbra console serve`), so at shutdown
    every child process it has is a provider's and is ended."""
    console = build_console(
        settings, release_verifier=release_verifier, stack_factory=stack_factory
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if settings.auto_migrate:
            await run_in_threadpool(db.upgrade, settings.database_url)
        log.info("console starting: %s", settings_summary(settings))
        if console.oidc is not None:
            console.oidc.refresh_soon()  # keys arrive in the background, before most requests
        await run_in_threadpool(provisioning.reconcile, console)
        console.leases.start()  # renews the leases of the jobs this replica runs
        if owns_process:
            notify.chain_exit_signals()  # long polls answer at SIGTERM, before the deadline
        summaries = asyncio.create_task(_flush_refusal_summaries(console))
        takeover = (
            asyncio.create_task(_reconcile_periodically(console))
            if not settings.is_sqlite and settings.reconcile_interval_seconds > 0
            else None
        )
        if console.watchdog is not None:
            console.watchdog.start()
        exporter = _start_exporter(console)
        maintenance = asyncio.create_task(_maintain_traffic(console))
        yield
        maintenance.cancel()
        if exporter is not None:
            exporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await exporter
        summaries.cancel()
        if takeover is not None:
            takeover.cancel()
        if console.watchdog is not None:
            await run_in_threadpool(console.watchdog.stop)
        await run_in_threadpool(_stop_jobs, console, owns_process)
        await run_in_threadpool(console.leases.stop)
        with contextlib.suppress(Exception):  # a database that is down loses only the counts
            await run_in_threadpool(lambda: refusal_budget.flush(console, final=True))
        console.engine.dispose()

    app = FastAPI(
        title="Umbra Console",
        version=API_VERSION,
        description="Orchestrates and stores: identity, profiles, write-only secrets, CVMs, "
        "traffic and audit logs. Never in the SSH or egress path.",
        lifespan=lifespan,
    )
    app.state.console = console
    for module in (
        meta,
        login,
        bundles,
        cvms,
        session,
        secrets,
        team_settings,
        security_cvm,
        secret_refresh,
        traffic,
        usage,
        audit,
        enroll,
        reenroll,
        people,
    ):
        app.include_router(module.router)
    mount_web(app, console.settings.web_session_key)
    _install_error_handlers(app)
    route_errors.install(app)  # the services' domain errors, mapped to HTTP in one place
    _register_extra_schemas(app, [TrafficBatch])
    app.add_middleware(
        BodyLimitMiddleware,
        limit=limit_for(
            settings.max_request_bytes, settings.max_bundle_bytes, settings.max_traffic_batch_bytes
        ),
    )
    app.add_middleware(MetricsMiddleware, console=console)
    app.add_middleware(ErrorMiddleware)
    return app


def _start_exporter(console: Console) -> asyncio.Task[None] | None:
    """The SIEM export (console/export) when a receiver is configured."""
    settings = console.settings
    sinks = export_sinks.from_settings(
        settings.export_otlp_url, settings.export_syslog_url, settings.export_ca_file
    )
    if not sinks:
        return None
    exporter = export_runner.Exporter(
        engine=console.engine,
        sinks=sinks,
        interval=settings.export_interval_seconds,
        batch=settings.export_batch,
    )
    return asyncio.create_task(exporter.run())


def _traffic_maintenance_round(console: Console) -> None:
    traffic_retention.maintain(console.engine, console.settings, write_gate=console.write_gate)


async def _maintain_traffic(console: Console) -> None:
    """The first round at startup (a partition for today exists before the first busy hour),
    then every `TRAFFIC_MAINTENANCE_INTERVAL_SECONDS`."""
    while True:
        try:
            await run_in_threadpool(_traffic_maintenance_round, console)
        except Exception as exc:  # a database outage or a busy table: the next round retries
            log.warning("traffic maintenance failed (%s); retrying", type(exc).__name__)
        await asyncio.sleep(console.settings.traffic_maintenance_interval_seconds)


async def _flush_refusal_summaries(console: Console) -> None:
    """Refusal summaries of ended minutes reach the audit log even when no refusal follows."""
    while True:
        await asyncio.sleep(refusal_budget.WINDOW_SECONDS / 4)
        try:
            await run_in_threadpool(refusal_budget.flush, console)
        except Exception:  # a database outage: retried next round
            log.warning("could not write enrollment refusal summaries; retrying")


async def _reconcile_periodically(console: Console) -> None:
    """Jobs whose replica died (lease expired) are taken over by this one (provisioning.reconcile)."""
    interval = console.settings.reconcile_interval_seconds
    while True:
        await asyncio.sleep(interval)
        if console.stopping.is_set():
            return
        try:
            await run_in_threadpool(provisioning.reconcile, console)
        except Exception:  # a database outage: the next round retries
            log.warning("periodic reconcile failed; retrying")


def _stop_jobs(console: Console, owns_process: bool, grace: float = 3.0) -> None:
    """Shutdown within seconds: queued runs are cancelled, the provider's child processes are
    ended (so running ones fail fast and record it), and a run that still has not finished is
    left for `reconcile` at the next start."""
    console.stopping.set()  # runs failing from here on are left for `reconcile` (resumable)
    console.notifier.stop()
    console.jobs.shutdown(wait=False, cancel_futures=True)
    if owns_process and children.terminate_descendants(grace=grace):
        log.warning("ended provider child processes at shutdown")
    deadline = time.monotonic() + grace
    for thread in list(getattr(console.jobs, "_threads", ())):
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _register_extra_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Bodies that routes parse themselves (for speed) still appear in the OpenAPI spec."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # Never echo the input back: it may be a secret value.
        errors = [
            {
                "loc": list(error.get("loc", ())),
                "msg": error.get("msg", ""),
                "type": error.get("type", ""),
            }
            for error in exc.errors()
        ]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(IntegrityError)
    async def _conflict(request: Request, exc: IntegrityError) -> JSONResponse:
        # Named locks make this rare; if two writers still collide on a unique key, the loser's
        # answer is a retryable conflict. Only the type is logged: SQL parameters may be secrets.
        log.warning("conflict %s on %s %s", _db_error(exc), request.method, request.url.path)
        return JSONResponse({"detail": "conflicting concurrent change; retry"}, status_code=409)

    @app.exception_handler(DBAPIError)
    async def _database(request: Request, exc: DBAPIError) -> JSONResponse:
        log.error("database %s on %s %s", _db_error(exc), request.method, request.url.path)
        if isinstance(exc, OperationalError) or exc.connection_invalidated:
            return JSONResponse(
                {"detail": "the database is unavailable or too slow; retry later"},
                status_code=503,
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        return JSONResponse({"detail": "internal error"}, status_code=500)

    @app.exception_handler(SqlTimeoutError)
    async def _pool(request: Request, _exc: SqlTimeoutError) -> JSONResponse:
        log.error("database pool exhausted on %s %s", request.method, request.url.path)
        return JSONResponse(
            {"detail": "the database is busy; retry later"},
            status_code=503,
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )


def _db_error(exc: DBAPIError) -> str:
    """The driver's exception type, e.g. `psycopg.errors.UniqueViolation`: never its message,
    which quotes the statement's parameters."""
    original = exc.orig
    return type(original).__name__ if original is not None else type(exc).__name__


class ErrorMiddleware:
    """Outermost: an unexpected exception becomes a plain 500, logged by type only. (Starlette's
    own server-error handling re-raises, and the server then logs the whole traceback, which can
    hold request values.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception as exc:
            log.error("unhandled %s on %s %s", type(exc).__name__, scope["method"], scope["path"])
            if started:
                return
            response = JSONResponse({"detail": "internal error"}, status_code=500)
            await response(scope, receive, send)


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, console: Console) -> None:
        self.app = app
        self.console = console

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status_code = 500

        async def capture(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            route: Any = scope.get("route")
            template = getattr(route, "path", "unmatched")
            metrics = self.console.metrics
            metrics.requests.labels(template, scope["method"], str(status_code)).inc()
            metrics.latency.labels(template).observe(time.perf_counter() - started)
