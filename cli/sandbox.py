"""`umbra sandbox` (render release documents, sessions, the Dev CVM host) and `umbra forwarder`
(the egress relay)."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from umbra.cli.output import EXIT_USAGE, console, fail
from umbra.sandbox.sessions import (
    SessionError,
    attach_argv,
    parse_request,
    request_session,
    serve_launcher,
)

if TYPE_CHECKING:
    from umbra.sandbox.dev_host import DevHost

# Each command imports what it runs (templates, attestation, httpx) so `--help` stays light.

app = typer.Typer(
    help="Dev CVM sandbox: release documents and agent sessions.", no_args_is_help=True
)
host_app = typer.Typer(
    help="A cloud Dev CVM's sandbox and forwarder, from its measured dev-cvm.json.",
    no_args_is_help=True,
)
app.add_typer(host_app, name="host")
forwarder_app = typer.Typer(help="The Dev CVM's attested egress forwarder.", no_args_is_help=True)

SessionsDir = Annotated[Path, typer.Option("--sessions", help="Shared directory of dtach sockets.")]


@app.command()
def render(
    definition: Annotated[Path, typer.Argument(help="Image definition (YAML).")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write here, not stdout.")] = None,
) -> None:
    """Render and check a CVM's measured document: a Security CVM's docker-compose.yaml, a Dev
    CVM's dev-cvm.json."""
    from umbra.images.definition import DefinitionError, DevCvmDefinition, load_definition
    from umbra.sandbox.dev_definition import DevHostError, render_dev_host
    from umbra.sandbox.render import render_security_cvm
    from umbra.sandbox.validate import ComposeError

    try:
        d = load_definition(definition)
        rendered = (
            render_dev_host(d.host)
            if isinstance(d, DevCvmDefinition)
            else render_security_cvm(d.compose)
        )
    except (DefinitionError, ComposeError, DevHostError) as exc:
        fail(str(exc), EXIT_USAGE)
    if out is None:
        typer.echo(rendered.text, nl=False)
    else:
        out.write_text(rendered.text)
        console.print(f"wrote {out} (sha256 {rendered.sha256})")


@app.command()
def check(
    document: Annotated[Path, typer.Argument(help="A dev-cvm.json or docker-compose.yaml.")],
    role: Annotated[str, typer.Option(help="dev-cvm or security-cvm")] = "dev-cvm",
) -> None:
    """Check a measured document: a Dev CVM's host definition, or a Security CVM's compose file
    against the isolation rules (exit 1 with every violation)."""
    from umbra.sandbox.dev_definition import DevHostError, load_dev_host
    from umbra.sandbox.validate import ComposeError, validate_security_compose

    try:
        text = document.read_text()
    except OSError as exc:
        fail(f"cannot read {document}: {exc.strerror}", EXIT_USAGE)
    if role not in ("dev-cvm", "security-cvm"):
        fail("--role must be dev-cvm or security-cvm", EXIT_USAGE)
    try:
        if role == "dev-cvm":
            load_dev_host(text, str(document))
        else:
            validate_security_compose(text)
    except (ComposeError, DevHostError) as exc:
        fail(str(exc))
    console.print(f"[bold green]OK[/] {document}")


DefinitionOpt = Annotated[
    Path, typer.Option("--definition", "-d", help="The measured host definition.")
]
RootOpt = Annotated[Path, typer.Option("--root", help="The sandbox's directory (data disk).")]
ImageDirOpt = Annotated[
    Path, typer.Option("--image-dir", help="The sandbox image the OS image ships.")
]


def _dev_host(definition: Path, root: Path, image_dir: Path) -> DevHost:
    from umbra.sandbox import dev_host
    from umbra.sandbox.dev_definition import DevHostError

    try:
        return dev_host.load(definition, root, image_dir)
    except DevHostError as exc:
        fail(str(exc), EXIT_USAGE)


@host_app.command("up")
def host_up(
    definition: DefinitionOpt = Path("/run/umbra/launch/dev-cvm.json"),
    root: RootOpt = Path("/var/lib/umbra/data/dev-host"),
    image_dir: ImageDirOpt = Path("/usr/lib/umbra/sandbox-image"),
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Start the forwarder, the sandbox (runc) and their supervisor, as the launch agent does."""
    from umbra.cli.output import print_json
    from umbra.sandbox import dev_host
    from umbra.sandbox.dev_definition import DevHostError

    host = _dev_host(definition, root, image_dir)
    try:
        state = dev_host.up(host, definition)
    except DevHostError as exc:
        fail(str(exc))
    if as_json:
        print_json(state)
    else:
        console.print(
            f"[bold green]up[/] {host.cvm_id}: sandbox pid {state['sandbox_pid']}, "
            f"forwarder pid {state['forwarder_pid']}, supervisor pid {state['supervisor_pid']}"
        )


@host_app.command("supervise", hidden=True)
def host_supervise(
    definition: DefinitionOpt = Path("/run/umbra/launch/dev-cvm.json"),
    root: RootOpt = Path("/var/lib/umbra/data/dev-host"),
    image_dir: ImageDirOpt = Path("/usr/lib/umbra/sandbox-image"),
) -> None:
    """Restart a dead sandbox or forwarder until stopped (started by `host up`)."""
    from umbra.sandbox import dev_host

    host = _dev_host(definition, root, image_dir)
    dev_host.supervise(host)


@host_app.command("down")
def host_down(
    definition: DefinitionOpt = Path("/run/umbra/launch/dev-cvm.json"),
    root: RootOpt = Path("/var/lib/umbra/data/dev-host"),
    image_dir: ImageDirOpt = Path("/usr/lib/umbra/sandbox-image"),
) -> None:
    """Stop the supervisor, the sandbox and the forwarder; the sandbox's files stay."""
    from umbra.sandbox import dev_host

    host = _dev_host(definition, root, image_dir)
    dev_host.down(host)
    console.print(f"down {host.cvm_id}")


@host_app.command("status")
def host_status(
    definition: DefinitionOpt = Path("/run/umbra/launch/dev-cvm.json"),
    root: RootOpt = Path("/var/lib/umbra/data/dev-host"),
    image_dir: ImageDirOpt = Path("/usr/lib/umbra/sandbox-image"),
) -> None:
    """The sandbox's, the forwarder's and the supervisor's pids (JSON)."""
    from umbra.cli.output import print_json
    from umbra.sandbox import dev_host

    host = _dev_host(definition, root, image_dir)
    print_json(dev_host.status(host))


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
    run_as: Annotated[
        int | None,
        typer.Option(
            "--run-as",
            min=1,
            help="started as root: enroll and bind, then run on as this uid (and gid)",
        ),
    ] = None,
) -> None:
    """Relay sandbox TCP to the attested Security CVM; refuse everything else."""
    from umbra.sandbox.forwarder_config import ForwarderConfigError, load_forwarder_config
    from umbra.sandbox.forwarder_enroll import ensure_tunnel_credential
    from umbra.sandbox.forwarder_setup import build_forwarder, drop_forwarder_privileges
    from umbra.sandbox.privileges import PrivilegeError

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    if run_as is not None and os.geteuid() != 0:
        fail(f"--run-as {run_as} needs the forwarder started as root", EXIT_USAGE)
    try:
        cfg = load_forwarder_config(config)
        ensure_tunnel_credential(cfg)  # enrolls at first start when the config says how
        forwarder = build_forwarder(cfg)
    except ForwarderConfigError as exc:
        fail(str(exc), EXIT_USAGE)

    def started() -> None:
        if run_as is not None:
            drop_forwarder_privileges(forwarder, run_as)

    try:
        asyncio.run(forwarder.serve_forever(started))
    except PrivilegeError as exc:
        fail(f"cannot drop root: {exc}")
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


class _NotReady(Exception):
    """The ingress listens, but systemd could not be told (its Type=notify unit would time out
    after minutes and say nothing of why)."""


@app.command()
def ingress(
    config: Annotated[Path, typer.Option("--config", "-c", help="ingress config (YAML/JSON).")],
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """The Dev CVM's attested SSH ingress: aTLS on one port, a gateway sshd behind it."""
    from umbra.sandbox.ingress import Ingress
    from umbra.sandbox.ingress_config import IngressConfigError, load_ingress_config
    from umbra.sandbox.sd_notify import notify_ready

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)

    async def run() -> None:
        server = await Ingress(load_ingress_config(config)).start()
        addr = server.sockets[0].getsockname()
        console.print(f"ingress listening on {addr[0]}:{addr[1]}", highlight=False)
        try:
            notify_ready()  # umbra-ingress.service is Type=notify: started means listening
        except OSError as exc:
            server.close()
            raise _NotReady(exc) from None
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(run())
    except IngressConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    except _NotReady as exc:
        fail(
            f"listening, but cannot tell systemd it is ready (NOTIFY_SOCKET "
            f"{os.environ.get('NOTIFY_SOCKET')!r}: {exc}); stopped"
        )
    except OSError as exc:
        fail(f"cannot listen: {exc}", EXIT_USAGE)
