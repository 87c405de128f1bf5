"""`umbra ssh`, `umbra claude|codex|shell`, `umbra code|cursor`,
`umbra config-ssh`, `umbra ssh-proxy`: the developer's session path over attested SSH
(`umbra sessions` is `cli/sessions.py`).

Every connection goes through `umbra ssh-proxy` (the ProxyCommand), which verifies the Dev CVM's
quote before one SSH byte flows; ssh itself then checks the server's host key against the one the
quote bound (StrictHostKeyChecking yes, a known_hosts file written only from attested keys).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from umbra.cli.auth import team_call
from umbra.cli.output import EXIT_USAGE, console, fail, print_json
from umbra.cli.ssh_config import (
    SshConfigError,
    diff,
    render,
    replace_atomically,
    ssh_argv,
)
from umbra.console.enums import CvmKind, CvmState
from umbra.sandbox.sessions import AGENTS, DEFAULT_NAME, DTACH_OPTS, SessionError, check_request

if TYPE_CHECKING:  # for annotations: the client and schemas load when a command runs
    from umbra.console.schemas import CvmInfo

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
CvmArg = Annotated[
    str | None, typer.Argument(help="Dev CVM name or id (default: your only running one).")
]
CvmOpt = Annotated[str | None, typer.Option("--cvm", help="Dev CVM name or id.")]
NameOpt = Annotated[str, typer.Option("--name", "-n", help="Session name.")]
ReuseOpt = Annotated[
    bool, typer.Option("--reuse/--no-reuse", help="OpenSSH connection reuse (ControlMaster).")
]

ssh_app = typer.Typer(add_completion=False)
proxy_app = typer.Typer(add_completion=False)
claude_app = typer.Typer(add_completion=False)
codex_app = typer.Typer(add_completion=False)
shell_app = typer.Typer(add_completion=False)
code_app = typer.Typer(add_completion=False)
cursor_app = typer.Typer(add_completion=False)
config_ssh_app = typer.Typer(add_completion=False)


def _dev_cvms(team: str | None, as_json: bool) -> list[CvmInfo]:
    _, cvms = team_call(team, as_json, lambda c, t: c.list_cvms(t))
    return [c for c in cvms if c.kind == CvmKind.dev]


def pick_cvm(wanted: str | None, as_json: bool = False) -> CvmInfo:
    """The named CVM (name or id), else the caller's only running Dev CVM."""
    cvms = _dev_cvms(None, as_json)
    if wanted:
        for cvm in cvms:
            if wanted in (cvm.id, cvm.name):
                return cvm
        fail(f"no Dev CVM {wanted!r} of yours", EXIT_USAGE, as_json=as_json)
    running = [c for c in cvms if c.state == CvmState.running]
    if len(running) == 1:
        return running[0]
    choices = ", ".join(f"{c.name} ({c.id}, {c.state})" for c in cvms) or "none"
    fail(f"pass a CVM name or --cvm; your Dev CVMs: {choices}", EXIT_USAGE, as_json=as_json)


def _exec(argv: list[str]) -> NoReturn:
    if shutil.which(argv[0]) is None:
        fail(f"{argv[0]} is not installed", EXIT_USAGE)
    sys.stdout.flush()
    os.execvp(argv[0], argv)  # noqa: S606 -- become ssh/the IDE: the terminal is theirs


@ssh_app.command("ssh")
def ssh(
    cvm: CvmArg = None,
    command: Annotated[
        list[str] | None, typer.Argument(help="Command to run in the sandbox (after --).")
    ] = None,
    cvm_opt: CvmOpt = None,
    reuse: ReuseOpt = True,
) -> None:
    """Open a shell (or run a command) in your sandbox over attested SSH."""
    if cvm is not None and "--" in sys.argv and sys.argv[sys.argv.index("--") + 1 :][:1] == [cvm]:
        command = [cvm, *(command or [])]  # `umbra ssh -- cmd`: no CVM was named
        cvm = None
    target = pick_cvm(cvm_opt or cvm)
    remote = [" ".join(command)] if command else []  # as ssh does: the remote shell parses it
    _exec([*ssh_argv(target.id, reuse=reuse), *remote])


@proxy_app.command("ssh-proxy")
def ssh_proxy(cvm_id: Annotated[str, typer.Argument(help="The Dev CVM's id.")]) -> None:
    """OpenSSH ProxyCommand: verify the Dev CVM's quote, then relay stdin/stdout."""
    from umbra.cli import ssh_proxy as proxy

    raise typer.Exit(proxy.main([cvm_id]))


def agent_command(agent: str, name: str) -> str:
    """The remote command: attach to the agent's dtach session, starting it if needed.

    `dtach -A` attaches to a live master or (socket missing or stale) starts one; the agent keeps
    running when the connection drops, and the next attach reaches the same process."""
    try:
        check_request(agent, name)
    except SessionError as exc:
        fail(str(exc), EXIT_USAGE)
    sock = f'"$UMBRA_SESSIONS"/{agent}-{name}.dtach'
    argv = shlex.join(["dtach", "-A", "SOCK", *DTACH_OPTS, *AGENTS[agent]])
    return 'mkdir -p "$UMBRA_SESSIONS" && exec ' + argv.replace("SOCK", sock, 1)


def _agent(agent: str, cvm: str | None, name: str, reuse: bool) -> NoReturn:
    target = pick_cvm(cvm)
    _exec([*ssh_argv(target.id, reuse=reuse, extra=["-t"]), agent_command(agent, name)])


@claude_app.command("claude")
def claude(cvm: CvmArg = None, name: NameOpt = DEFAULT_NAME, reuse: ReuseOpt = True) -> None:
    """Attach to (or start) Claude Code in your sandbox, permission prompts off."""
    _agent("claude", cvm, name, reuse)


@codex_app.command("codex")
def codex(cvm: CvmArg = None, name: NameOpt = DEFAULT_NAME, reuse: ReuseOpt = True) -> None:
    """Attach to (or start) Codex in your sandbox, approvals off."""
    _agent("codex", cvm, name, reuse)


@shell_app.command("shell")
def shell(cvm: CvmArg = None, name: NameOpt = DEFAULT_NAME, reuse: ReuseOpt = True) -> None:
    """Attach to (or start) a persistent shell session in your sandbox."""
    _agent("shell", cvm, name, reuse)


def _ide(binary: str, cvm: str | None, path: str, dry_run: bool) -> None:
    if cvm is not None and cvm.startswith("/") and path == DEFAULT_IDE_PATH:
        path = cvm  # `umbra code /path`: the only CVM, that folder
        cvm = None
    target = pick_cvm(cvm)
    _write_ssh_config(_dev_cvms(None, False), dry_run=False, quiet=True)
    argv = [binary, "--remote", f"ssh-remote+umbra-{target.name}", path]
    if dry_run:
        print_json({"argv": argv})
        return
    _exec(argv)


DEFAULT_IDE_PATH = "/home/dev"
PathArg = Annotated[str, typer.Argument(help="Folder in the sandbox.")]
DryRunIde = Annotated[bool, typer.Option("--dry-run", help="Print the IDE command only.")]


@code_app.command("code")
def code(cvm: CvmArg = None, path: PathArg = DEFAULT_IDE_PATH, dry_run: DryRunIde = False) -> None:
    """Open VS Code on your sandbox via Remote-SSH (writes the ~/.ssh/config block first)."""
    _ide("code", cvm, path, dry_run)


@cursor_app.command("cursor")
def cursor(
    cvm: CvmArg = None, path: PathArg = DEFAULT_IDE_PATH, dry_run: DryRunIde = False
) -> None:
    """Open Cursor on your sandbox via Remote-SSH (writes the ~/.ssh/config block first)."""
    _ide("cursor", cvm, path, dry_run)


def ssh_config_path() -> Path:
    return Path.home() / ".ssh" / "config"


def _write_ssh_config(cvms: list[CvmInfo], *, dry_run: bool, quiet: bool = False) -> str:
    path = ssh_config_path()
    try:
        current = path.read_text() if path.exists() else ""
        new = render(current, [(c.name, c.id) for c in cvms if c.state != CvmState.destroyed])
    except (OSError, UnicodeDecodeError, SshConfigError) as exc:
        fail(f"{path}: {exc}", EXIT_USAGE)
    change = diff(current, new, path)
    if not dry_run and change:
        try:
            replace_atomically(path, new)
        except OSError as exc:
            fail(f"{path}: cannot write: {exc}", EXIT_USAGE)
    if not quiet:
        sys.stdout.write(change if dry_run else "")
    return change


@config_ssh_app.command("config-ssh")
def config_ssh(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show the diff; change nothing.")
    ] = False,
    team: Annotated[str | None, typer.Option(help="Team (default: your only one).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Write one `Host umbra-<name>` per Dev CVM into a managed block of ~/.ssh/config."""
    cvms = _dev_cvms(team, as_json)
    change = _write_ssh_config(cvms, dry_run=dry_run, quiet=as_json)
    if as_json:
        print_json(
            {
                "path": str(ssh_config_path()),
                "changed": bool(change),
                "dry_run": dry_run,
                "hosts": [f"umbra-{c.name}" for c in cvms],
                "diff": change,
            }
        )
    elif not dry_run:
        console.print(
            f"{'Updated' if change else 'Unchanged'} {ssh_config_path()}: "
            + (", ".join(f"umbra-{c.name}" for c in cvms) or "no Dev CVMs")
        )
