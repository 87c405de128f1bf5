"""`umbra sandbox` (render compose files, sessions) and `umbra forwarder` (the egress relay)."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Annotated

import typer

from umbra.cli.output import EXIT_USAGE, console, fail
from umbra.sandbox.sessions import (
    SessionError,
    attach_argv,
    parse_request,
    request_session,
    serve_launcher,
)

# Each command imports what it runs (templates, attestation, httpx) so `--help` stays light.

app = typer.Typer(help="Dev CVM sandbox: compose files and agent sessions.", no_args_is_help=True)
forwarder_app = typer.Typer(help="The Dev CVM's attested egress forwarder.", no_args_is_help=True)

SessionsDir = Annotated[Path, typer.Option("--sessions", help="Shared directory of dtach sockets.")]


@app.command()
def render(
    definition: Annotated[Path, typer.Argument(help="Image definition (YAML).")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write here, not stdout.")] = None,
) -> None:
    """Render and validate a CVM's docker-compose.yaml."""
    from umbra.images.definition import DefinitionError, DevCvmDefinition, load_definition
    from umbra.sandbox.render import render_dev_cvm, render_security_cvm
    from umbra.sandbox.validate import ComposeError

    try:
        d = load_definition(definition)
        rendered = (
            render_dev_cvm(d.compose)
            if isinstance(d, DevCvmDefinition)
            else render_security_cvm(d.compose)
        )
    except (DefinitionError, ComposeError) as exc:
        fail(str(exc), EXIT_USAGE)
    if out is None:
        typer.echo(rendered.text, nl=False)
    else:
        out.write_text(rendered.text)
        console.print(f"wrote {out} (sha256 {rendered.sha256})")


@app.command()
def check(
    compose: Annotated[Path, typer.Argument(help="A docker-compose.yaml to check.")],
    role: Annotated[str, typer.Option(help="dev-cvm or security-cvm")] = "dev-cvm",
) -> None:
    """Check a compose file against the isolation rules (exit 1 with every violation)."""
    from umbra.sandbox.validate import ComposeError, validate_dev_compose, validate_security_compose

    try:
        text = compose.read_text()
    except OSError as exc:
        fail(f"cannot read {compose}: {exc.strerror}", EXIT_USAGE)
    if role not in ("dev-cvm", "security-cvm"):
        fail("--role must be dev-cvm or security-cvm", EXIT_USAGE)
    try:
        (validate_dev_compose if role == "dev-cvm" else validate_security_compose)(text)
    except ComposeError as exc:
        fail(str(exc))
    console.print(f"[bold green]OK[/] {compose}")


@app.command()
def session(sessions: SessionsDir = Path("/run/umbra/sessions")) -> None:
    """sshd's ForceCommand: start or reattach the agent named in SSH_ORIGINAL_COMMAND."""
    try:
        agent, name = parse_request(os.environ.get("SSH_ORIGINAL_COMMAND"))
        argv = attach_argv(request_session(sessions, agent, name))
    except SessionError as exc:
        fail(str(exc))
    os.execv(argv[0], argv)  # noqa: S606 -- become dtach: the SSH session is the attach


@app.command()
def launcher(sessions: SessionsDir = Path("/run/umbra/sessions")) -> None:
    """Inside the sandbox: start agents under dtach when the session helper asks."""

    async def run() -> None:
        server = await serve_launcher(sessions)
        async with server:
            await server.serve_forever()

    asyncio.run(run())


@forwarder_app.command()
def serve(
    config: Annotated[Path, typer.Option("--config", "-c", help="forwarder.json")],
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Relay sandbox TCP to the attested Security CVM; refuse everything else."""
    from umbra.sandbox.forwarder_config import ForwarderConfigError, load_forwarder_config
    from umbra.sandbox.forwarder_enroll import ensure_tunnel_credential
    from umbra.sandbox.forwarder_setup import build_forwarder

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    try:
        cfg = load_forwarder_config(config)
        ensure_tunnel_credential(cfg)  # enrolls at first start when the config says how
        forwarder = build_forwarder(cfg)
    except ForwarderConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    try:
        asyncio.run(forwarder.serve_forever())
    except OSError as exc:
        fail(f"cannot listen: {exc}", EXIT_USAGE)


@forwarder_app.command()
def enroll(
    config: Annotated[Path, typer.Option("--config", "-c", help="forwarder.json")],
) -> None:
    """Trade the launch data's one-time token for the tunnel credential (attested), once."""
    from umbra.sandbox.forwarder_config import ForwarderConfigError, load_forwarder_config
    from umbra.sandbox.forwarder_enroll import ensure_tunnel_credential

    try:
        enrolled = ensure_tunnel_credential(load_forwarder_config(config))
    except ForwarderConfigError as exc:
        fail(str(exc))
    typer.echo("enrolled" if enrolled else "already enrolled")


@app.command()
def ingress(
    config: Annotated[Path, typer.Option("--config", "-c", help="ingress config (YAML/JSON).")],
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """The Dev CVM's attested SSH ingress: aTLS on one port, a gateway sshd behind it."""
    from umbra.sandbox.ingress import Ingress
    from umbra.sandbox.ingress_config import IngressConfigError, load_ingress_config

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)

    async def run() -> None:
        server = await Ingress(load_ingress_config(config)).start()
        addr = server.sockets[0].getsockname()
        console.print(f"ingress listening on {addr[0]}:{addr[1]}", highlight=False)
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(run())
    except IngressConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    except OSError as exc:
        fail(f"cannot listen: {exc}", EXIT_USAGE)
