"""`umbra up | down | status`: the whole of Umbra on this machine, on embedded defaults.

The machinery is the `up_stack` package; the walkthrough (`--check`) is `up_check.py`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.table import Table

from umbra.cli.output import EXIT_FINDINGS, EXIT_USAGE, console, fail, print_json, stderr

StateDir = Annotated[
    Path,
    typer.Option(
        "--state-dir", envvar="UMBRA_STATE_DIR", help="Where `umbra up` keeps everything."
    ),
]
PortBase = Annotated[
    int,
    typer.Option(
        "--port-base",
        envvar="UMBRA_UP_PORT_BASE",
        min=1024,
        max=65000,
        help="First of six loopback ports (issuer, Console, proxy, tunnel, demo origin, model API; "
        "--runtime qemu: two more, the Console's TLS front and a PCCS).",
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]

# How `umbra status` colours each up_stack.Health (by value: the module is imported lazily).
_COLOUR = {"healthy": "green", "unhealthy": "yellow", "not running": "red", "down": "red"}

up_app = typer.Typer(help="Start Umbra on this machine (embedded defaults).")
down_app = typer.Typer(help="Stop everything `umbra up` started.")
status_app = typer.Typer(help="What `umbra up` started, and whether it is healthy.")


def _stack(state_dir: Path, port_base: int) -> Any:
    from umbra.cli.up_stack import Stack

    stack = Stack(state_dir.resolve(), port_base)
    stack.load()
    return stack


def _fail(exc: Exception, as_json: bool) -> NoReturn:
    fail(str(exc), fix=getattr(exc, "fix", ""), as_json=as_json)


@up_app.callback(invoke_without_command=True)
def up(
    state_dir: StateDir = Path(".umbra"),
    port_base: PortBase = 7080,
    policies: Annotated[
        Path, typer.Option(help="The team's policy directory (profiles/ and tests/).")
    ] = Path("policies"),
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Then run the walkthrough inside the Dev CVM (qemu: the day, reboot and stop "
            "and start included).",
        ),
    ] = False,
    internet: Annotated[
        bool,
        typer.Option(help="With --check: also pip download and git ls-remote real hosts."),
    ] = False,
    short: Annotated[
        bool,
        typer.Option(
            "--short",
            help="With --runtime qemu --check: no reset, and only the Dev VM stopped and started "
            "(its idle auto-stop's path; a Security CVM never stops on its own): two TCG boots "
            "less than the full check.",
        ),
    ] = False,
    runtime: Annotated[
        str | None,
        typer.Option(
            "--runtime",
            help="What runs the CVMs: runc (the Dev CVM a sandbox on this machine, the Security "
            "CVM a process) or qemu (both the built OS image booted under QEMU through the "
            "Console's qemu provider). Default: the state directory's, else runc.",
        ),
    ] = None,
    shape: Annotated[
        str | None,
        typer.Option(
            "--shape", help="With --runtime qemu: the cloud the VMs are booted as, gcp or azure."
        ),
    ] = None,
    accel: Annotated[
        str,
        typer.Option(
            "--accel", help="With --runtime qemu: auto (KVM where it works, else TCG), kvm, tcg."
        ),
    ] = "auto",
    as_json: JsonFlag = False,
) -> None:
    """Start the Console, a development OIDC issuer, a Security CVM and a Dev CVM (a process and
    a local sandbox, or with --runtime qemu both the built OS image under QEMU)."""
    from umbra.cli import up_stack as s
    from umbra.sandbox.local_cvm import LocalCvmError

    options = _runtime_options(runtime, shape, accel, internet, as_json)
    if short and (not check or runtime == "runc"):
        fail("--short only with --check and --runtime qemu", EXIT_USAGE, as_json=as_json)
    stack = _stack(state_dir, port_base)
    quiet = as_json

    def step(text: str) -> None:
        if not quiet:
            console.print(f"[bold cyan]▸[/] {text}")
        # Also with --json: where a slow or stuck run stands is in logs/up.log.
        with contextlib.suppress(OSError):
            stack.p("logs").mkdir(parents=True, exist_ok=True)
            with stack.p("logs", "up.log").open("a") as log:
                log.write(f"{time.strftime('%H:%M:%S')} [{os.getpid()}] {text}\n")

    stack.progress = step
    started = time.monotonic()
    summary: dict[str, Any] = {}
    try:
        with stack.locked():
            _switch_runtime(stack, *options)
            step("Checking root, system packages and ports")
            s.preflight(stack)
            prefix = os.environ.get("UMBRA_UP_NAME_PREFIX")
            if prefix:
                stack.state["name_prefix"] = prefix
            stack.state["internet"] = internet
            stack.state["vendor_standins"] = os.environ.get(s.VENDOR_ENV) == "1"
            if stack.state["vendor_standins"]:
                step(f"warning: {s.VENDOR_ENV}=1: {', '.join(s.VENDOR_HOSTS)} are answered by the "
                     "stand-in model API (tests only)")  # fmt: skip
            stack.save()
            step("Preparing keys, the simulated TEE and golden values")
            s.prepare_material(stack)
            try:
                if s.runtime(stack) is s.Runtime.qemu:
                    _prepare_qemu(stack, accel, step, summary)
                _bring_up(stack, policies.resolve(), step, summary)
            except BaseException:
                if not stack.state.get("completed_once"):
                    s.down(stack)  # nothing half-started is left behind
                raise
            stack.state["completed_once"] = True
            stack.save()
            if check and s.runtime(stack) is s.Runtime.qemu:
                _check_qemu(stack, summary, step, quiet, short)
            elif check:
                _check(stack, summary, internet, step, quiet)
    except (s.UpError, LocalCvmError, OSError) as exc:
        _fail(exc, as_json)
    summary["seconds"] = round(time.monotonic() - started, 1)
    # The stack is up either way; a failed --internet or qemu check is this command's failure.
    failed = summary.get("internet_ok") is False or summary.get("check_ok") is False
    if as_json:
        print_json({"ok": not failed, **summary})
        if failed:
            raise typer.Exit(EXIT_FINDINGS)
        return
    cvm = summary["dev_cvm_id"]
    console.print(
        f"\n[green]Umbra is up[/] in {summary['seconds']} s. Dashboard: "
        f"[bold]{summary['dashboard_url']}[/]"
    )
    if summary.get("runtime") == "qemu":
        serial = stack.p("qemu", cvm)
        console.print(
            f"The Security CVM {summary['security_cvm_id']} and the Dev CVM {cvm} are VMs under "
            f"QEMU ({summary['shape']} shape, {summary['accel']}); the Dev CVM's serial "
            f"consoles: {serial}/serial-N.log\n"
            "Next:\n"
            "  umbra ssh                  # attested, into the sandbox in the VM\n"
            "  umbra cvm list             # its state as the Console records it\n"
            "  umbra status               # what runs, its QEMU included\n"
            "  umbra down                 # power button, then everything stops"
        )
    else:
        console.print(
            "Next:\n"
            "  umbra ssh                  # a shell in the Dev CVM (attested SSH ingress)\n"
            "  umbra ssh -- CMD           # run one command there\n"
            "  umbra claude               # Claude Code in a dtach session (reattaches after a drop)\n"
            f"  umbra logs --cvm {cvm}     # every request it made, allowed or denied\n"
            "  umbra status               # what runs, and whether it is healthy\n"
            "  umbra down                 # stop everything"
        )
    if failed:
        stderr.print("[red]a check failed (above); the stack itself is up.[/]")
        raise typer.Exit(EXIT_FINDINGS)


def _runtime_options(
    runtime: str | None, shape: str | None, accel: str, internet: bool, as_json: bool
) -> tuple[str | None, str | None, str, bool]:
    """--runtime, --shape, --accel checked together (usage errors, before anything runs); with
    no --runtime, the state directory's decides (`_switch_runtime`)."""
    from umbra.cli.up_stack.qemu import ACCELS, Runtime
    from umbra.emulated.metadata import Shape

    if runtime is not None and runtime not in set(Runtime):
        fail(f"--runtime {runtime!r}: one of runc, qemu", EXIT_USAGE, as_json=as_json)
    if shape is not None and shape not in set(Shape):
        fail(f"--shape {shape!r}: one of gcp, azure", EXIT_USAGE, as_json=as_json)
    if accel not in ACCELS:
        fail(f"--accel {accel!r}: one of {', '.join(ACCELS)}", EXIT_USAGE, as_json=as_json)
    if runtime == Runtime.runc:
        given = [f for f, v in (("--shape", shape), ("--accel", accel != "auto")) if v]
        if given:
            fail(f"{', '.join(given)} only with --runtime qemu", EXIT_USAGE, as_json=as_json)
    if runtime == Runtime.qemu and internet:
        fail(_NO_INTERNET, EXIT_USAGE, as_json=as_json)
    return runtime, shape, accel, internet


_NO_INTERNET = "--internet runs pip and git in the local sandbox; not with --runtime qemu"


def _switch_runtime(
    stack: Any, runtime: str | None, shape: str | None, accel: str, internet: bool
) -> None:
    """The state directory remembers its runtime and shape (the next `umbra up` without
    --runtime keeps them); changing them needs the stack down (the Console reads its providers
    at start)."""
    from umbra.cli import up_stack as s

    was = (str(s.runtime(stack)), stack.state.get("shape"))
    wanted = runtime or was[0]
    if wanted == s.Runtime.runc and (shape or accel != "auto"):
        raise s.UpError("--shape and --accel only with --runtime qemu", "add --runtime qemu")
    if wanted == s.Runtime.qemu and internet:
        raise s.UpError(_NO_INTERNET, "leave out --internet")
    if wanted == s.Runtime.qemu:
        shape = shape or (was[1] if was[0] == s.Runtime.qemu else None) or "gcp"
    if was != (wanted, shape) and stack.pid(s.Component.CONSOLE) is not None:
        raise s.UpError(
            f"the stack in {stack.state_dir} runs with --runtime {was[0]}"
            + (f" --shape {was[1]}" if was[1] else "")
            + f"; this asks for --runtime {wanted}"
            + (f" --shape {shape}" if shape else ""),
            "run `umbra down` first (or use another --state-dir)",
        )
    stack.state["runtime"] = wanted
    if shape is None:
        stack.state.pop("shape", None)
    else:
        stack.state["shape"] = shape


def _prepare_qemu(stack: Any, accel: str, step: Any, summary: dict[str, Any]) -> None:
    """The qemu OS image (built once per source tree), the Dev release and the provider's
    config, before any component starts."""
    from umbra.cli.up_stack import os_disk, qemu

    step("The qemu OS image and its boot disk (built once per source tree, then cached)")
    disk = os_disk.ensure_disk(step)
    chosen = qemu.choose_accel() if accel == "auto" else accel
    if accel == "auto" and chosen == "tcg":
        step("QEMU: TCG (no working KVM here; a boot takes minutes)")
    stack.state["accel"] = chosen
    qemu.write_security_release(stack, disk.proxy_digest)
    qemu.write_dev_release(stack)
    qemu.write_provider_config(stack, disk.raw, chosen)
    stack.save()
    summary.update(runtime="qemu", shape=stack.state["shape"], accel=chosen, os_disk=str(disk.raw))


def _bring_up(stack: Any, policies: Path, step: Any, summary: dict[str, Any]) -> None:
    from umbra.cli import up_stack as s

    step(f"Development OIDC issuer on {stack.issuer_url} (auto-approves the local user)")
    s.start_issuer(stack)
    step(f"Console on {stack.console_url} (SQLite, migrated)")
    s.start_console(stack)
    if s.runtime(stack) is s.Runtime.qemu:
        step(f"TLS for the Console's name in VMs on port {stack.port(s.Port.CONSOLE_TLS)}")
        s.start_console_front(stack)
        step(f"PCCS of the simulated PKI on port {stack.port(s.Port.PCCS)} (the tunnel relays it)")
        s.start_pccs(stack)
    env = dict(os.environ)
    step(f"Logging in as {s.SUBJECT} (device flow against the development issuer)")
    s.login(stack, env)
    identity, public_key = s.ssh_identity(stack)
    s.save_client_opt_ins(stack, identity)
    summary["ssh_identity"] = str(identity)
    with s.api(stack, s.token(env)) as client:
        step(f"Publishing the signed bundle built from {policies} (+ the demo profile)")
        summary["bundle_serial"] = s.publish_bundle(stack, client, policies)
        on_qemu = s.runtime(stack) is s.Runtime.qemu
        if on_qemu:
            shape = stack.state["shape"]
            step(f"Team {s.TEAM!r} with you as admin; launching its Security CVM through the "
                 f"Console (qemu provider: {shape} shape)")  # fmt: skip
        else:
            step(f"Team {s.TEAM!r} with you as admin; its Security CVM")
        summary["security_cvm_id"] = s.ensure_security_cvm(stack, client)
        secret = stack.p("keys", "demo-token")
        if not secret.exists():
            s.write_secret(secret, ("demo_" + secrets.token_urlsafe(24)).encode())
        s.ensure_demo_secret(client, secret.read_text().strip())
        s.ensure_llm_secrets(stack, client)
        step("Stand-in origin and model API for the walkthrough (their own CA)")
        s.start_origin(stack)
        s.start_llm_origin(stack)
        if on_qemu:
            step(f"Launching the Dev CVM through the Console (qemu provider: {shape} shape)")
        else:
            step("Sandbox image: Debian trixie, Claude Code, Codex, Docker (built once, cached)")
            summary["sandbox_image"] = [str(p) for p in s.ensure_sandbox_image(stack)]
            step("Launching the Dev CVM through the Console (local provider: runc)")
        summary["dev_cvm_id"] = s.ensure_dev_cvm(
            stack, client, summary["security_cvm_id"], [public_key]
        )
        if not on_qemu:
            step("Security CVM: egress proxy + aTLS tunnel endpoint on the simulated TEE")
            s.start_proxy(stack)
            s.wait_sandbox_ca(stack, summary["dev_cvm_id"])
    summary["console_url"] = stack.console_url
    summary["dashboard_url"] = stack.console_url + "/ui/"


def _check(stack: Any, summary: dict[str, Any], internet: bool, step: Any, quiet: bool) -> None:
    from umbra.cli import up_check as c
    from umbra.cli import up_stack as s

    cvm = summary["dev_cvm_id"]
    step("Walkthrough inside the sandbox (as its root)")

    def report(probe: Any, code: int, error: str) -> None:
        ok = code == probe.expect_status
        mark = "[green]✓[/]" if ok else "[red]✗[/]"
        if not quiet:
            console.print(
                f"   {mark} {probe.method} {probe.host}{probe.path} → {code} ({probe.name})"
            )

    with s.api(stack, s.token(dict(os.environ))) as client:
        secret = stack.p("keys", "demo-token").read_text().strip()
        records = c.run_check(stack, client, cvm, report, secret)
    summary["check"] = {
        "records": [
            {
                k: r.get(k)
                for k in ("cvm_id", "method", "connect_host", "decision", "reason", "owner")
            }
            for r in records
        ]
    }
    if not quiet:
        step(f"The records in the Console (umbra logs --cvm {cvm}):")
        subprocess.run([s.umbra_executable(), "logs", "--cvm", cvm, "--limit", "8"], check=False)
    step(f"Attested SSH: umbra ssh {cvm} -- id -u (quote verified, then a command as the user)")
    summary["check"]["ssh"] = c.run_ssh_check(cvm)
    if not quiet:
        console.print(f"   [green]✓[/] {summary['check']['ssh']['detail']}")
    step("The real agents in the sandbox: claude -p and codex exec against the stand-in API")

    def agent_shown(result: Any) -> None:
        if not quiet:
            mark = "[green]✓[/]" if result.ok else "[red]✗[/]"
            console.print(f"   {mark} {result.detail} ({result.seconds} s)", highlight=False)

    agents = c.run_agent_check(c.sandbox_runner(stack, cvm), c.llm_endpoints(stack), agent_shown)
    summary["check"]["agents"] = {r.name: r.as_json() for r in agents}
    if internet:
        step("--internet: pip download and git ls-remote against the real hosts")

        def shown(result: Any) -> None:
            if not quiet:
                mark = "[green]✓[/]" if result.ok else "[red]✗[/]"
                console.print(
                    f"   {mark} {result.name} ({result.host}, {result.seconds} s): {result.detail}",
                    highlight=False,
                )

        results = c.run_internet(stack, cvm, report=shown)
        summary["internet"] = {r.name: r.as_json() for r in results}
        summary["internet_ok"] = all(r.ok for r in results)


def _check_qemu(stack: Any, summary: dict[str, Any], step: Any, quiet: bool, short: bool) -> None:
    from umbra.cli import up_check_qemu as c
    from umbra.cli import up_stack as s

    cvm = summary["dev_cvm_id"]
    step(f"The seed's day against the VMs of the Security CVM and the Dev CVM {cvm} (each step "
         "bounded; a boot takes minutes on TCG)")  # fmt: skip

    def shown(result: Any) -> None:
        if not quiet:
            mark = "[green]✓[/]" if result.ok else "[red]✗[/]"
            console.print(
                f"   {mark} {result.name} ({result.seconds} s): {result.detail}", highlight=False
            )

    with s.api(stack, s.token(dict(os.environ))) as client:
        secret = stack.p("keys", "demo-token").read_text().strip()
        results = c.run_check(stack, client, cvm, secret, shown, short)
    summary["check"] = {"steps": {r.name: r.as_json() for r in results}}
    summary["check_ok"] = all(r.ok for r in results)


@down_app.callback(invoke_without_command=True)
def down(
    state_dir: StateDir = Path(".umbra"), port_base: PortBase = 7080, as_json: JsonFlag = False
) -> None:
    """Stop every process and remove every namespace, veth and mount `umbra up` made."""
    from umbra.cli import up_stack as s

    stack = _stack(state_dir, port_base)
    started = time.monotonic()
    try:
        with stack.locked():
            stopped = s.down(stack)
    except (s.UpError, OSError) as exc:
        _fail(exc, as_json)
    seconds = round(time.monotonic() - started, 2)
    if as_json:
        print_json({"ok": True, "stopped": stopped, "seconds": seconds})
        return
    console.print(f"Stopped {', '.join(stopped) or 'nothing (nothing was running)'} in {seconds} s")


@status_app.callback(invoke_without_command=True)
def status(
    state_dir: StateDir = Path(".umbra"), port_base: PortBase = 7080, as_json: JsonFlag = False
) -> None:
    """Each component: running, healthy; each Dev CVM: its runtime and processes."""
    from umbra.cli import up_stack as s

    stack = _stack(state_dir, port_base)
    report = s.status(stack)
    healthy = all(c["healthy"] for c in report["components"].values()) and all(
        c["healthy"] for c in report["dev_cvms"] + report["security_cvms"]
    )
    report["healthy"] = healthy and bool(report["dev_cvms"])
    if as_json:
        print_json(report)
    else:
        table = Table(title=f"umbra up: {report['state_dir']}")
        for column in ("component", "pid", "state"):
            table.add_column(column)
        for name, c in report["components"].items():
            health = s.component_health(c)
            table.add_row(name, str(c["pid"] or "-"), f"[{_COLOUR[health]}]{health}[/]")
        for cvm in report["dev_cvms"]:
            health = s.Health.HEALTHY if cvm["healthy"] else s.Health.DOWN
            state = f"[{_COLOUR[health]}]{health}[/]"
            if cvm["runtime"] == "qemu":
                processes = f"qemu {cvm['qemu_pid'] or '-'} ({cvm['shape']} shape, {cvm['accel']})"
            else:
                processes = (
                    f"sandbox {cvm['sandbox_pid'] or '-'}, forwarder {cvm['forwarder_pid'] or '-'}, "
                    f"ssh ingress {cvm['ingress_pid'] or '-'}"
                )
            table.add_row(f"dev cvm {cvm['cvm_id']} (runtime: {cvm['runtime']})", processes, state)
        for cvm in report["security_cvms"]:
            health = s.Health.HEALTHY if cvm["healthy"] else s.Health.DOWN
            processes = f"qemu {cvm['qemu_pid'] or '-'} ({cvm['shape']} shape, {cvm['accel']})"
            table.add_row(f"security cvm {cvm['cvm_id']} (runtime: qemu)", processes,
                          f"[{_COLOUR[health]}]{health}[/]")  # fmt: skip
        console.print(table)
        console.print(f"Console: {report['console_url']}")
        if not report["healthy"]:
            console.print("Run [bold]umbra up[/] to restart what is down.")
    if not report["healthy"]:
        raise typer.Exit(EXIT_FINDINGS)
