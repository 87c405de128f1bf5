"""`umbra console ...`: run the Console, migrate its database, verify its audit chain, run
traffic retention."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from umbra.cli.output import EXIT_USAGE, fail
from umbra.cli.output import console as out
from umbra.console.config import ConfigError, Settings, settings_from_env

app = typer.Typer(
    help="Run and maintain the Umbra Console (settings come from UMBRA_CONSOLE_* variables).",
    no_args_is_help=True,
)

DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url", help="Overrides UMBRA_CONSOLE_DATABASE_URL.", show_default=False
    ),
]


def _settings(database_url: str | None, **overrides: object) -> Settings:
    extra = {key: value for key, value in overrides.items() if value is not None}
    if database_url is not None:
        extra["database_url"] = database_url
    try:
        return settings_from_env(None, **extra)
    except ConfigError as exc:
        fail(f"the Console's configuration: {exc}", EXIT_USAGE)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
    workers: Annotated[
        int, typer.Option(min=1, help="Worker processes (PostgreSQL only; SQLite uses one).")
    ] = 1,
    database_url: DatabaseUrl = None,
    migrate: Annotated[
        bool | None,
        typer.Option(
            "--migrate/--no-migrate",
            help="Apply migrations before serving; without it an unmigrated database is refused.",
        ),
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(help="PEM certificate chain: serve HTTPS.", show_default=False)
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option(help="PEM private key of --tls-cert.", show_default=False)
    ] = None,
) -> None:
    """Serve the Console API (OpenAPI at /openapi.json, metrics at /metrics)."""
    from umbra.console.serve import serve as run

    settings = _settings(database_url, auto_migrate=migrate)
    try:
        run(settings, host, port, workers=workers, tls_cert=tls_cert, tls_key=tls_key)
    except ConfigError as exc:
        fail(f"the Console's configuration: {exc}", EXIT_USAGE)


@app.command()
def migrate(
    database_url: DatabaseUrl = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Apply the Console's Alembic migrations (PostgreSQL in production; SQLite too)."""
    from umbra.console import db

    settings = _settings(database_url)
    db.upgrade(settings.database_url, revision)
    out.print(f"database at revision [bold]{revision}[/bold]")


@app.command("audit-verify")
def audit_verify(
    database_url: DatabaseUrl = None,
    expect_head: Annotated[
        str | None,
        typer.Option(
            help="A head hash recorded earlier: fail unless the chain still passes through it "
            "(catches truncation and wholesale rewrites)."
        ),
    ] = None,
) -> None:
    """Recompute the audit log's hash chain; exit 1 at the first entry that does not verify."""
    from sqlalchemy.orm import Session

    from umbra.console import audit, db

    settings = _settings(database_url)
    engine = db.make_engine(settings.database_url)
    try:
        with Session(engine) as session:
            # The whole chain; its result becomes the checkpoint the audit page continues from.
            report = audit.verify_full(session, expect_head.lower() if expect_head else None)
    finally:
        engine.dispose()
    if not report.ok:
        fail(
            f"audit chain BROKEN at seq {report.bad_seq}: {report.problem} "
            f"({report.entries} entries verified before it)"
        )
    if expect_head is not None and not report.anchor_found:
        fail(
            f"audit chain does not contain the recorded head {expect_head} "
            "(entries were removed or the chain was rewritten)"
        )
    out.print(f"audit chain OK: {report.entries} entries, head {report.head}")


@app.command()
def retention(database_url: DatabaseUrl = None) -> None:
    """Run one traffic maintenance round now: partitions ahead (PostgreSQL), then retention
    (UMBRA_CONSOLE_TRAFFIC_RETENTION_DAYS), waiting for the SIEM export cursors when export is
    configured. A serving Console does the same every TRAFFIC_MAINTENANCE_INTERVAL_SECONDS."""
    from umbra.console import db, traffic_retention

    settings = _settings(database_url)
    if settings.traffic_retention_days is None:
        fail(
            "UMBRA_CONSOLE_TRAFFIC_RETENTION_DAYS is not set: traffic records are kept forever",
            EXIT_USAGE,
        )
    engine = db.make_engine(settings.database_url)
    try:
        run = traffic_retention.maintain(engine, settings)
    finally:
        engine.dispose()
    if run is None:
        out.print("another Console process is running retention now; nothing done")
        return
    out.print(
        f"traffic before {run.cutoff.isoformat()} expired: {len(run.partitions_dropped)} day "
        f"partitions dropped, {run.records_deleted} records deleted"
    )
    if run.waiting_for_export:
        cursors = ", ".join(f"{sink}={pos}" for sink, pos in run.export_positions.items())
        out.print(
            f"{run.waiting_for_export} expired records kept until SIEM export has them "
            f"(traffic cursors {cursors})"
        )
    if run.busy:
        out.print(f"busy, retried next round: {', '.join(run.busy)}")
