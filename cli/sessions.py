"""`umbra sessions [list] [CVM]`, `umbra sessions kill NAME`: the agent sessions (dtach masters) in
your sandbox. `umbra sessions CVM` still lists (an unknown first word is read as `list CVM`).

Killing runs one POSIX sh script in the sandbox over the same attested SSH path as every session:
it finds the dtach processes whose socket argument is the session's socket (the master and any
attached clients, started by `umbra claude|codex|shell` or by the launcher), ends the agent's
process group (the master's child leads its own session), then the master (dtach unlinks its
socket when it gets SIGTERM), SIGKILL after 5 s, and removes a socket no process holds."""

from __future__ import annotations

import shlex
import subprocess
from typing import Annotated, Any

import typer
from typer import _click as click
from typer.core import TyperGroup

from umbra.cli.output import EXIT_FINDINGS, EXIT_USAGE, console, fail, print_json
from umbra.cli.ssh_config import ssh_argv
from umbra.sandbox.sessions import AGENTS, SessionError, check_request

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
CvmArg = Annotated[
    str | None, typer.Argument(help="Dev CVM name or id (default: your only running one).")
]
CvmOpt = Annotated[str | None, typer.Option("--cvm", help="Dev CVM name or id.")]
ReuseOpt = Annotated[
    bool, typer.Option("--reuse/--no-reuse", help="OpenSSH connection reuse (ControlMaster).")
]


class _ListByDefault(TyperGroup):
    """`umbra sessions`, `umbra sessions CVM --json`: the list, as before sessions had verbs."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        first = args[0] if args else None
        if not ctx.resilient_parsing and first not in (*self.commands, "--help"):
            args = ["list", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(cls=_ListByDefault, add_completion=False, help="Your sandbox's agent sessions.")

LIST_SESSIONS = (
    'cd "$UMBRA_SESSIONS" 2>/dev/null || exit 0; '
    'for s in *.dtach; do [ -S "$s" ] && printf "%s\\n" "$s"; done; exit 0'
)

# $1..: candidate socket names. Prints `match <name>` per candidate when not exactly one exists,
# else `killed <name> <pids>` or `stale <name>`. Names are checked ([a-z0-9-]) and quoted.
KILL_SESSION = r"""
cd "$UMBRA_SESSIONS" 2>/dev/null || exit 0
read -r me _ < /proc/self/stat  # the pids below must be this pid namespace's
[ "$me" = "$$" ] || { echo "foreign-proc -"; exit 0; }
found=
for s in "$@"; do [ -S "$s" ] && found="$found $s"; done
set -- $found
if [ "$#" -ne 1 ]; then for s in "$@"; do echo "match $s"; done; exit 0; fi
name=$1
pids=
for d in /proc/[0-9]*; do
  case "$(tr '\0' '\n' < "$d/cmdline" 2>/dev/null | sed -n 1p)" in *dtach) ;; *) continue ;; esac
  sock=$(tr '\0' '\n' < "$d/cmdline" 2>/dev/null | sed -n 3p)
  case "$sock" in
    "$UMBRA_SESSIONS/$name"|"$PWD/$name") pids="$pids ${d#/proc/}" ;;
  esac
done
if [ -z "$pids" ]; then rm -f "$name"; echo "stale $name"; exit 0; fi
for p in $pids; do
  for f in $(grep -l "^PPid:[[:space:]]*$p\$" /proc/[0-9]*/status 2>/dev/null); do
    c=${f#/proc/}; c=${c%/status}
    kill -HUP -- "-$c" 2>/dev/null; kill -TERM -- "-$c" 2>/dev/null
  done
done
kill -TERM $pids 2>/dev/null
i=0
while [ -S "$name" ] && [ "$i" -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
if [ -S "$name" ]; then kill -KILL $pids 2>/dev/null; rm -f "$name"; fi
echo "killed $name$pids"
"""


def _run(cvm: str | None, reuse: bool, remote: str, as_json: bool) -> tuple[str, str, str]:
    """(CVM id, CVM name, the script's stdout)."""
    from umbra.cli.ssh import pick_cvm  # the Console client loads when a command runs

    target = pick_cvm(cvm, as_json)
    done = subprocess.run(
        [*ssh_argv(target.id, reuse=reuse), remote], capture_output=True, text=True
    )
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["ssh failed"]
        fail(last[0], as_json=as_json)
    return target.id, target.name, done.stdout


def _session(socket_name: str) -> dict[str, str] | None:
    agent, _, name = socket_name.removesuffix(".dtach").partition("-")
    return {"agent": agent, "name": name} if agent in AGENTS and name else None


@app.command("list")
def list_(cvm: CvmArg = None, reuse: ReuseOpt = True, as_json: JsonFlag = False) -> None:
    """List the agent sessions in your sandbox."""
    cvm_id, cvm_name, out = _run(cvm, reuse, LIST_SESSIONS, as_json)
    rows = [row for row in map(_session, out.split()) if row is not None]
    if as_json:
        print_json({"cvm": cvm_id, "sessions": rows})
        return
    if not rows:
        console.print(f"No sessions in {cvm_name}.", markup=False)
    for row in rows:
        console.print(f"{row['agent']:8} {row['name']}", markup=False)


@app.command("kill")
def kill(
    name: Annotated[str, typer.Argument(help="Session name (as in `umbra claude --name`).")],
    agent: Annotated[
        str | None, typer.Option(help="claude, codex or shell (needed if several match).")
    ] = None,
    cvm: CvmOpt = None,
    reuse: ReuseOpt = True,
    as_json: JsonFlag = False,
) -> None:
    """End an agent session: the agent, its dtach master and attached clients."""
    agents = [agent] if agent else sorted(AGENTS)
    try:
        for each in agents:
            check_request(each, name)
    except SessionError as exc:
        fail(str(exc), EXIT_USAGE, as_json=as_json)
    candidates = [f"{each}-{name}.dtach" for each in agents]
    remote = "sh -c " + shlex.quote(KILL_SESSION) + " umbra-kill " + shlex.join(candidates)
    cvm_id, cvm_name, out = _run(cvm, reuse, remote, as_json)
    words = out.split()
    matches = [
        _session(w) for verb, w in zip(words[::2], words[1::2], strict=False) if verb == "match"
    ]
    if words[:1] == ["foreign-proc"]:
        fail(f"{cvm_name}: /proc is not the sandbox's own; cannot find the session's processes",
             as_json=as_json)  # fmt: skip
    if not words or words[0] == "match":
        if matches:
            which = ", ".join(f"{m['agent']}/{m['name']}" for m in matches if m)
            fail(f"{which} match {name!r}: pass --agent", EXIT_USAGE, as_json=as_json)
        fail(f"no session {name!r} in {cvm_name}; `umbra sessions` lists them", EXIT_FINDINGS,
             as_json=as_json)  # fmt: skip
    result: dict[str, Any] = {"cvm": cvm_id, **(_session(words[1]) or {}), "state": words[0]}
    if as_json:
        print_json({"ok": True, **result})
        return
    what = "stale socket removed" if words[0] == "stale" else "ended"
    console.print(f"{result['agent']}/{result['name']} in {cvm_name}: {what}", markup=False)
