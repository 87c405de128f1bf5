"""`umbra proxy`: run the Security CVM's egress proxy."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

app = typer.Typer(help="The Security CVM's policy-enforcing egress proxy.", no_args_is_help=True)


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise typer.BadParameter("expected HOST:PORT, e.g. 127.0.0.1:8080")
    return host.strip("[]"), int(port)


@app.command()
def serve(
    listen: Annotated[
        str, typer.Option(help="HOST:PORT to accept tunnel connections on.")
    ] = "127.0.0.1:8080",
    identities: Annotated[
        Path,
        typer.Option(
            help="Identities file: CVM ids, owners, teams, profiles, tunnel credentials/source ranges."
        ),
    ] = Path("identities.yaml"),
    traffic_log: Annotated[
        Path, typer.Option(help="Traffic-log spool directory (append-only JSON lines).")
    ] = Path("traffic-spool"),
    confdir: Annotated[
        Path, typer.Option(help="Directory of the proxy's interception CA (created if missing).")
    ] = Path("mitm-ca"),
    policy_dir: Annotated[
        Path | None, typer.Option(help="Local mode: enforce this policy directory (unsigned).")
    ] = None,
    bundle: Annotated[Path | None, typer.Option(help="Enforce this signed bundle file.")] = None,
    bundle_key: Annotated[
        list[Path] | None,
        typer.Option(help="Pinned Ed25519 public key (PEM) bundles must be signed by; repeatable."),
    ] = None,
    console: Annotated[
        str | None,
        typer.Option(help="Console base URL: pull bundle and attachments, ship the traffic log."),
    ] = None,
    security_cvm_id: Annotated[
        str | None, typer.Option(help="This Security CVM's id at the Console.")
    ] = None,
    state_dir: Annotated[
        Path | None, typer.Option(help="Where the last good bundle is cached.")
    ] = None,
    secrets: Annotated[
        Path | None, typer.Option(help="Local mode secrets file (YAML/JSON, mode 0600).")
    ] = None,
    upstream_ca: Annotated[
        Path | None,
        typer.Option(
            help="Trust this CA (PEM) for upstream TLS instead of the system store (tests)."
        ),
    ] = None,
    max_body: Annotated[
        int,
        typer.Option(help="Largest request body scanned and forwarded, in bytes; larger gets 413."),
    ] = 32 << 20,
    tunnel_listen: Annotated[
        str | None,
        typer.Option(
            help="HOST:PORT of the aTLS tunnel endpoint for Dev CVM forwarders (same process)."
        ),
    ] = None,
    quote_source: Annotated[
        str,
        typer.Option(
            help="Tunnel endpoint quotes: configfs (the TD's configfs-tsm), azure (vTPM + IMDS under the paravisor) or simulated."
        ),
    ] = "configfs",
    event_log: Annotated[
        Path | None,
        typer.Option(help="Event log (dstack JSON or CCEL) served with the endpoint's quotes."),
    ] = None,
    simulated_pki: Annotated[
        Path | None,
        typer.Option(help="SIMULATED TEE only: the simulated PKI directory that signs quotes."),
    ] = None,
    simulated_image: Annotated[
        str, typer.Option(help="SIMULATED TEE only: the simulated image name.")
    ] = "umbra-security-cvm",
    tunnel_header_timeout: Annotated[
        float, typer.Option(help="Seconds a tunnel may take to send its identity header.")
    ] = 10.0,
    console_credential_file: Annotated[
        Path | None,
        typer.Option(
            help="File holding the bearer credential the Console issued this Security CVM."
        ),
    ] = None,
    enroll_token_file: Annotated[
        Path | None,
        typer.Option(
            help="The one-time enrollment token from launch data: with no credential in "
            "--console-credential-file yet, enroll (attested) and store the credential there."
        ),
    ] = None,
    secrets_from_console: Annotated[
        bool,
        typer.Option(
            help="Take injection secrets from the Console's attested release (needs --console)."
        ),
    ] = False,
    security_cvm_id_file: Annotated[
        Path | None,
        typer.Option(help="Read this Security CVM's id from a (launch-bound) file."),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            help="Proxy worker processes sharing the listen port (SO_REUSEPORT); default: cores."
        ),
    ] = 0,
    test_allow_upstream: Annotated[
        list[str] | None,
        typer.Option(
            help="TEST ONLY: allow dialling this CIDR (e.g. 127.0.0.1/32). Never in production."
        ),
    ] = None,
    test_resolver: Annotated[
        Path | None,
        typer.Option(help="TEST ONLY: resolve names from this JSON map instead of DNS."),
    ] = None,
) -> None:
    """Run the proxy until interrupted."""
    from umbra.proxy.enroll import ensure_console_credential
    from umbra.proxy.runner import ProxyConfig, StartupError, UmbraProxy, WorkerSupervisor

    host, port = _listen(listen)
    tunnel_host, tunnel_port = _listen(tunnel_listen) if tunnel_listen else (None, 8443)
    if quote_source not in ("configfs", "azure", "simulated"):
        typer.echo(
            "umbra proxy serve: --quote-source must be configfs, azure or simulated", err=True
        )
        raise typer.Exit(2)
    if security_cvm_id_file is not None:
        if security_cvm_id is not None:
            typer.echo("umbra proxy serve: give --security-cvm-id or its file, not both", err=True)
            raise typer.Exit(2)
        try:
            security_cvm_id = security_cvm_id_file.read_text().strip()
        except OSError as exc:
            typer.echo(f"umbra proxy serve: {security_cvm_id_file}: {exc.strerror}", err=True)
            raise typer.Exit(1) from None
    try:
        config = ProxyConfig(
            listen_host=host,
            listen_port=port,
            identities=identities,
            traffic_log=traffic_log,
            confdir=confdir,
            policy_dir=policy_dir,
            bundle=bundle,
            bundle_keys=bundle_key or [],
            console_url=console,
            security_cvm_id=security_cvm_id,
            console_credential_file=console_credential_file,
            enroll_token_file=enroll_token_file,
            secrets_from_console=secrets_from_console,
            state_dir=state_dir,
            secrets=secrets,
            upstream_ca=upstream_ca,
            max_body=max_body,
            test_allow_upstream=test_allow_upstream or [],
            test_resolver=test_resolver,
            tunnel_listen_host=tunnel_host,
            tunnel_listen_port=tunnel_port,
            quote_source=quote_source,
            event_log=event_log,
            simulated_pki=simulated_pki,
            simulated_image=simulated_image,
            tunnel_header_timeout=tunnel_header_timeout,
            workers=workers or os.cpu_count() or 1,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        typer.echo(f"umbra proxy serve: {first['msg']}", err=True)
        raise typer.Exit(2) from None
    try:
        if ensure_console_credential(config):
            typer.echo(
                f"umbra proxy serve: enrolled; credential in {config.console_credential_file}"
            )
    except StartupError as exc:
        typer.echo(f"umbra proxy serve: {exc}", err=True)
        raise typer.Exit(1) from None
    if config.workers > 1:
        try:
            code = WorkerSupervisor(config).run()
        except StartupError as exc:
            typer.echo(f"umbra proxy serve: {exc}", err=True)
            raise typer.Exit(1) from None
        raise typer.Exit(code)
    proxy = UmbraProxy(config)
    try:
        asyncio.run(proxy.run())
    except StartupError as exc:
        typer.echo(f"umbra proxy serve: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass
