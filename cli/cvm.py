"""`umbra cvm`: launch, list, update and destroy CVMs through the Console.

Cloud providers answer at once with a transitional state (`launching`, `updating`,
`destroying`); `--wait` follows the CVM until it settles and exits 1 if it ends `failed`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from umbra.cli.auth import api_errors, api_failure, open_client, resolve_team, team_call
from umbra.cli.output import EXIT_FINDINGS, EXIT_USAGE, console, fail, print_json, stderr
from umbra.console.enums import CvmKind, CvmState, Power
from umbra.contracts.enrollment import security_token_key

if TYPE_CHECKING:  # for annotations: the client and schemas load when a command runs
    from umbra.console.client import ConsoleClient
    from umbra.console.schemas import CvmInfo

app = typer.Typer(help="Launch, list, update and destroy CVMs.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
TeamOption = Annotated[
    str | None, typer.Option("--team", help="Team (default: your login's team, or your only one).")
]
SshKeyOption = Annotated[
    list[Path] | None,
    typer.Option("--ssh-key", help="An SSH public key file (repeat); cloud providers need one."),
]
SizeOption = Annotated[str | None, typer.Option(help="Machine type (provider default if unset).")]
DiskOption = Annotated[
    int | None,
    typer.Option(
        "--data-disk-gb",
        min=1,
        max=65536,
        help="Dev CVMs: data disk size in GB, within the team's bounds (`umbra machine-types`).",
    ),
]
WaitFlag = Annotated[bool, typer.Option("--wait", help="Follow the CVM until it settles.")]
TRANSITIONAL = (CvmState.launching, CvmState.updating, CvmState.destroying)


def _keys(paths: list[Path] | None, as_json: bool) -> list[str] | None:
    if not paths:
        return None
    keys: list[str] = []
    for path in paths:
        try:
            lines = [line.strip() for line in path.read_text().splitlines()]
        except OSError as exc:
            fail(f"--ssh-key {path}: {exc.strerror}", EXIT_USAGE, as_json=as_json)
        if any("PRIVATE KEY" in line for line in lines):
            fail(
                f"--ssh-key {path} is a private key; pass the .pub file",
                EXIT_USAGE,
                as_json=as_json,
            )
        keys += [line for line in lines if line and not line.startswith("#")]
    return keys


def _default_key(as_json: bool) -> list[str] | None:
    """No --ssh-key: the key the session commands will offer. Not for the `umbra up` Console,
    whose Dev CVMs take the key `umbra up` gave them, nor with UMBRA_SSH_IDENTITY set."""
    import os

    from umbra.cli.credentials import embedded_client
    from umbra.cli.ssh_config import IDENTITY_ENV
    from umbra.cli.ssh_key import SshKeyError, default_public_key

    if os.environ.get(IDENTITY_ENV) or embedded_client() is not None:
        return None
    try:
        pub, created = default_public_key()
    except SshKeyError as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)
    # One line on stderr, so `--json` stdout stays one document.
    if created:
        stderr.print(
            f"Created SSH key {pub} (no --ssh-key given, none in ~/.ssh)",
            markup=False,
            soft_wrap=True,
        )
    else:
        stderr.print(f"Using SSH key {pub} (no --ssh-key given)", markup=False, soft_wrap=True)
    return _keys([pub], as_json)


def _wait(client: ConsoleClient, cvm: CvmInfo, timeout: float = 1800) -> CvmInfo:
    deadline = time.monotonic() + timeout
    shown = len(cvm.events)
    while cvm.state in TRANSITIONAL and time.monotonic() < deadline:
        time.sleep(1.0)
        cvm = client.get_cvm(cvm.id)
        for event in cvm.events[shown:]:
            # Progress goes to stderr so that `--json` stdout stays one document.
            stderr.print(f"  [dim]{event.kind}[/] {event.message}", highlight=False)
        shown = len(cvm.events)
    return cvm


def _show(cvm: CvmInfo, as_json: bool, credential: str | None = None) -> None:
    if as_json:
        doc = cvm.model_dump(mode="json")
        if credential is not None:
            doc["credential"] = credential
        print_json(doc)
    else:
        where = cvm.provider_state.get("private_ip") or "-"
        console.print(
            f"{cvm.id} [bold]{cvm.name}[/] ({cvm.kind}, {cvm.provider}) is [bold]{cvm.state}[/]"
            f" private IP {where}"
            + (f", data disk {cvm.data_disk_gb} GB" if cvm.data_disk_gb is not None else ""),
            highlight=False,
        )
        if cvm.kind == CvmKind.dev:
            # What governs its egress: the Security CVM and the profiles attached (at launch,
            # the team's defaults).
            console.print(
                f"  egress via Security CVM {cvm.security_cvm_id or '(none: all refused)'};"
                f" profiles: {', '.join(cvm.profiles) or 'none'}",
                highlight=False,
            )
        if cvm.replica_index is not None:
            console.print(
                f"  replica {cvm.replica_index} of the Security CVM pool "
                f"{cvm.replica_of or cvm.id} (run by the team stack)",
                highlight=False,
            )
        if cvm.state_reason:
            console.print(f"  reason: {cvm.state_reason}", highlight=False)
        if credential is not None:
            console.print("Security CVM credential (shown once, store it in the CVM now):")
            console.print(credential, highlight=False, soft_wrap=True)
    if cvm.state == CvmState.failed:
        raise typer.Exit(EXIT_FINDINGS)


@app.command()
def launch(
    name: Annotated[str, typer.Argument(help="CVM name, unique in the team.")],
    provider: Annotated[str, typer.Option(help="Provider adapter: local, gcp, azure.")] = "local",
    kind: Annotated[CvmKind, typer.Option(help="dev or security.")] = CvmKind.dev,
    ssh_key: SshKeyOption = None,
    size: SizeOption = None,
    data_disk_gb: DiskOption = None,
    security_cvm: Annotated[
        str | None, typer.Option("--security-cvm", help="Dev CVMs: route egress via this id.")
    ] = None,
    owner: Annotated[str | None, typer.Option(help="Owner (admins; default: you).")] = None,
    team: TeamOption = None,
    wait: WaitFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Launch a CVM (a Dev CVM without --ssh-key: your ~/.ssh key, else one umbra makes)."""
    keys = _keys(ssh_key, as_json)
    if keys is None and kind == "dev":
        keys = _default_key(as_json)
    client, login = open_client(as_json)
    try:
        with client:
            team_name = resolve_team(client, login, team, as_json)
            created: CvmInfo = client.create_cvm(
                team_name,
                name,
                kind=kind,
                provider=provider,
                security_cvm_id=security_cvm,
                owner=owner,
                ssh_keys=keys,
                size=size,
                data_disk_gb=data_disk_gb,
            )
            cvm: CvmInfo = _wait(client, created) if wait else created
    except api_errors() as exc:
        api_failure(exc, as_json)
    _show(cvm, as_json)


@app.command("list")
def list_cvms(
    team: TeamOption = None,
    all_: Annotated[bool, typer.Option("--all", help="Include destroyed CVMs.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """CVMs of the team (admins: all; developers: their own)."""
    team_name, rows = team_call(team, as_json, lambda c, t: c.list_cvms(t, include_destroyed=all_))
    if as_json:
        print_json([row.model_dump(mode="json") for row in rows])
        return
    table = Table(title=f"CVMs of {team_name}")
    for column in ("id", "name", "kind", "owner", "provider", "state", "private IP", "profiles"):
        table.add_column(column)
    for row in rows:
        state = row.state if not row.state_reason else f"{row.state}: {row.state_reason}"
        table.add_row(
            row.id,
            row.name,
            row.kind,
            row.owner,
            row.provider,
            state,
            str(row.provider_state.get("private_ip") or "-"),
            ", ".join(row.profiles) or "-",
        )
    console.print(table)


@app.command()
def update(
    cvm_id: Annotated[str, typer.Argument(help="CVM id (cvm_...).")],
    state: Annotated[Power | None, typer.Option(help="Start or stop (local).")] = None,
    ssh_key: SshKeyOption = None,
    size: SizeOption = None,
    data_disk_gb: Annotated[
        int | None,
        typer.Option(
            "--data-disk-gb", min=1, max=65536, help="Grow the Dev CVM's data disk to this (GB)."
        ),
    ] = None,
    security_cvm: Annotated[
        str | None, typer.Option("--security-cvm", help="Re-route a Dev CVM (admins).")
    ] = None,
    wait: WaitFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Start/stop a CVM, re-route it, or change its SSH keys, size or data disk."""
    keys = _keys(ssh_key, as_json)
    asked = (state, keys, size, data_disk_gb, security_cvm)
    if all(value is None for value in asked):
        fail(
            "nothing to change: pass --state, --ssh-key, --size, --data-disk-gb or --security-cvm",
            EXIT_USAGE,
            as_json=as_json,
        )
    client, _login = open_client(as_json)
    try:
        with client:
            cvm = client.update_cvm(
                cvm_id,
                state=state,
                security_cvm_id=security_cvm,
                ssh_keys=keys,
                size=size,
                data_disk_gb=data_disk_gb,
            )
            cvm = _wait(client, cvm) if wait else cvm
    except api_errors() as exc:
        api_failure(exc, as_json)
    _show(cvm, as_json)


@app.command("enrollment-token")
def enrollment_token(
    cvm_id: Annotated[str, typer.Argument(help="CVM id (cvm_...).")],
    as_json: JsonFlag = False,
) -> None:
    """Mint a one-time enrollment token for a CVM's launch data (admins; valid 1 h).

    The CVM trades it, with a quote of its release, for its credential (credentials only after
    attestation). Put it where the launch data's `umbra-enrollment-token` goes, nowhere else."""
    client, _login = open_client(as_json)
    try:
        with client:
            minted = client.enrollment_token(cvm_id)
    except api_errors() as exc:
        api_failure(exc, as_json)
    if as_json:
        print_json(minted.model_dump(mode="json"))
        return
    console.print(
        f"One-time enrollment token for {cvm_id} (expires {minted.expires_at:%H:%M} UTC):"
    )
    console.print(minted.token, highlight=False, soft_wrap=True)


@app.command("security-replica")
def security_replica(
    replica: Annotated[
        int, typer.Argument(min=0, max=7, help="Replica number in the team stack (0 = first).")
    ],
    team: TeamOption = None,
    token_only: Annotated[
        bool,
        typer.Option(
            "--token-only",
            help="Print only the token, to pipe into `pulumi config set --secret KEY`.",
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Register replica N of the team's Security CVM pool and mint its one-time token (admins).

    Run once per replica before `pulumi up`, and again for a replica that booted after its
    token expired (valid 1 h) or whose VM is relaunched: the record stays, the token is new."""
    team_name, minted = team_call(team, as_json, lambda c, t: c.security_replica_token(t, replica))
    if as_json:
        print_json(minted.model_dump(mode="json"))
        return
    if token_only:
        typer.echo(minted.token)
        return
    key = security_token_key(replica).split(":", 1)[1]
    what = "registered" if minted.created else "already registered"
    console.print(
        f"Replica {replica} of team {team_name}'s Security CVM pool: {minted.cvm_id} ({what}; "
        f"Dev CVMs route to {minted.pool_id})",
        highlight=False,
    )
    console.print(
        f"One-time enrollment token (expires {minted.expires_at:%H:%M} UTC; the replica must "
        "boot and enroll before then):"
    )
    console.print(minted.token, highlight=False, soft_wrap=True)
    console.print(
        "In the team stack (the token at the prompt of the second command, or piped into it "
        "from `--token-only`):\n"
        f"  pulumi config set --path 'umbra:stack.security_cvm.cvm_ids[{replica}]' "
        f"{minted.cvm_id}\n"
        f"  pulumi config set --secret {key}",
        highlight=False,
        soft_wrap=True,
    )


@app.command()
def destroy(
    cvm_id: Annotated[str, typer.Argument(help="CVM id (cvm_...).")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    wait: WaitFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Destroy a CVM (its record stays for the logs)."""
    if not yes and not typer.confirm(f"Destroy {cvm_id}?"):
        fail("not confirmed", EXIT_USAGE, as_json=as_json)
    client, _login = open_client(as_json)
    try:
        with client:
            cvm = client.destroy_cvm(cvm_id)
            cvm = _wait(client, cvm) if wait else cvm
    except api_errors() as exc:
        api_failure(exc, as_json)
    _show(cvm, as_json)
