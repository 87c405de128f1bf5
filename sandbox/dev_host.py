"""A cloud Dev CVM's host side: the measured host definition (`dev-cvm.json`) made to run.

The launch agent, after measuring the launch data and loading the host firewall, runs
`umbra sandbox host up`: the same sandbox as `umbra up` (runc, the mmdebstrap image, the
forwarder in its own network namespace with its resolver and transparent ports), through
sandbox/local_cvm.py's functions, with what differs on a CVM:

- the image is the tree the OS image ships (`/usr/lib/umbra/sandbox-image`, the same layout as
  the build cache), and it must be the one the definition measures (both keys), built by the
  code that runs here (its own keys): otherwise nothing starts;
- the addresses are computed by local_cvm for the measured index and compared with the measured
  ones: a mismatch starts nothing (the host firewall names the measured uplink);
- the forwarder's namespace gets a default route to the host end of its uplink, and the host
  forwards (ip_forward=1): the measured host ruleset (components/host_firewall.py) admits the
  uplink only to the Security CVM's tunnel port and the Console's 443, and masquerades it;
- the forwarder keeps the sandbox's attested CA and its `sandbox.env` (the CVM's values, then
  the attached profiles' `sandbox_env`) current in the directories bound read-only into it, with
  the same config blocks as `umbra up`'s (`local_cvm.sandbox_env_config`): checked at start;
- a supervisor process (`umbra sandbox host supervise`, its pid in `supervisor.pid`, found again
  by the same marker check as every local CVM process) restarts a dead sandbox or forwarder.

Nothing here is TDX-specific; the forwarder's enrollment quotes through configfs-tsm as its
measured config says (not run on this machine: no TDX).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from umbra.attest.enroll_client import BOOT_RETRY_DELAYS
from umbra.contracts.files import write_atomic
from umbra.sandbox import image, local_cvm
from umbra.sandbox.dev_definition import (
    DEV_HOST_ROOT,
    DevCvmHost,
    DevHostError,
    load_dev_host,
    plan_for,
)
from umbra.sandbox.forwarder_config import ForwarderConfigError, read_cvm_id
from umbra.sandbox.local_cvm import LocalCvmError, LocalCvmPlan
from umbra.sandbox.render import CA_NAME

DEFINITION_PATH = Path("/run/umbra/launch/dev-cvm.json")
IMAGE_DIR = Path("/usr/lib/umbra/sandbox-image")
ROOT = Path(DEV_HOST_ROOT)
SUPERVISOR = "supervisor"
SUPERVISE_INTERVAL = 2.0
# How long `up` waits for the forwarder to listen: it listens only once enrolled, and at boot its
# enrollment retries an unanswering Console for BOOT_RETRY_DELAYS (about five minutes), plus the
# attempts themselves and Python's start (minutes under the emulated clouds' TCG on a loaded CI
# machine). A shorter wait failed launches while the enrollment was still within its budget
# (60 s at the first emulated-cloud boot; 422 s at CI's stop and start of both VMs). A forwarder
# that exits ends the wait at once (local_cvm.wait_role_listening): the bound is for a hang.
FORWARDER_START_TIMEOUT = sum(BOOT_RETRY_DELAYS) + 240.0


@dataclass(frozen=True)
class DevHost:
    definition: DevCvmHost
    cvm_id: str
    root: Path
    image_dir: Path

    @property
    def plan(self) -> LocalCvmPlan:
        return plan_for(self.cvm_id, self.definition.network.index, self.root)

    @property
    def sandbox_pid_file(self) -> Path:
        """Where runc keeps the sandbox's init pid (the attested ingress enters through it)."""
        return self.plan.dir / "sandbox.pid"

    @property
    def sessions_dir(self) -> Path:
        """The sandbox's dtach sockets as the host sees them (the idle auto-stop reads them)."""
        return self.plan.rootfs / self.definition.ssh_ingress.sessions_dir.lstrip("/")


def load(definition: Path, root: Path = ROOT, image_dir: Path = IMAGE_DIR) -> DevHost:
    """The measured definition and this CVM's id (the launch agent's file the forwarder reads)."""
    try:
        text = definition.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise DevHostError(f"{definition}: cannot read: {exc}") from None
    host = load_dev_host(text, str(definition))
    try:
        cvm_id = read_cvm_id(host.forwarder.cvm_id_file)
    except ForwarderConfigError as exc:
        raise DevHostError(str(exc)) from None
    return DevHost(host, cvm_id, root, image_dir)


def check(host: DevHost) -> None:
    """Everything that must hold before anything starts; each refusal says what and why."""
    d = host.definition
    keys = d.sandbox_image
    ours = (image.recipe_key(), image.files_key())
    if (keys.recipe_key, keys.files_key) != ours:
        raise DevHostError(
            f"sandbox_image: the release measures {keys.recipe_key}/{keys.files_key}, this OS "
            f"image's umbra builds {ours[0]}/{ours[1]}: a release and an OS image of different "
            "versions"
        )
    for ready in (host.image_dir / keys.recipe_key, host.image_dir / "files" / keys.files_key):
        if not (ready / "ready").is_file() or not (ready / "rootfs").is_dir():
            raise DevHostError(f"sandbox_image: {ready} is not a built image tree on this CVM")
    plan = host.plan
    computed = {
        "sandbox": plan.sandbox_addr,
        "forwarder": plan.forwarder_addr,
        "uplink": plan.uplink_addr,
        "host": plan.host_addr,
    }
    for field, address in computed.items():
        measured = getattr(d.network, field)
        if measured != address:
            raise DevHostError(
                f"network.{field}: measured {measured}, the runtime computes {address}: refusing "
                "to start a topology the host firewall does not describe"
            )
    want_ca = plan.dir / "sandbox-ca" / CA_NAME
    if d.forwarder.sandbox_ca is None or d.forwarder.sandbox_ca.file != want_ca:
        raise DevHostError(
            f"forwarder.sandbox_ca.file must be {want_ca}: the directory bound read-only into "
            "the sandbox, or the sandbox would never trust the CA the forwarder attested"
        )
    want_env = local_cvm.sandbox_env_config(plan)
    env = d.forwarder.sandbox_env
    if env is None or (str(env.file), env.base) != (want_env["file"], want_env["base"]):
        raise DevHostError(
            f"forwarder.sandbox_env must be {want_env['file']} with this topology's own values: "
            "the file bound read-only into the sandbox, or sessions would never see the attached "
            "profiles' sandbox_env"
        )


def _use_image(host: DevHost) -> None:
    # local_cvm finds the image through sandbox/image.py's cache; on a CVM that is the shipped,
    # read-only tree (same layout), never built here.
    os.environ["UMBRA_SANDBOX_CACHE"] = str(host.image_dir)


def _network(host: DevHost) -> None:
    plan = host.plan
    # Only the forwarder's side is made here: the sandbox's namespace is runc's, attached at each
    # sandbox start (local_cvm.start_sandbox).
    if not Path("/run/netns", plan.forwarder_ns).exists():
        local_cvm.stop(plan, "sandbox")
        local_cvm.delete_network(plan)
        local_cvm.create_network(plan, host.definition.tcp_ports)
    # The forwarder reaches the Security CVM and the Console through the host, which forwards
    # and masquerades only what the measured host ruleset admits.
    _ip("-n", plan.forwarder_ns, "route", "replace", "default",
        "via", plan.host_addr, "dev", plan.ifname("c"))  # fmt: skip
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise DevHostError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def up(host: DevHost, definition: Path, supervise: bool = True) -> dict[str, Any]:
    """Start the forwarder and the sandbox (and their supervisor); idempotent."""
    try:
        local_cvm.require_tools()
    except LocalCvmError as exc:
        raise DevHostError(str(exc)) from None
    check(host)
    _use_image(host)
    plan = host.plan
    plan.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (plan.dir / "forwarder.json").write_text(
        json.dumps(host.definition.forwarder.model_dump(mode="json", exclude_none=True))
    )
    _write_simulated_root(host)
    try:
        _network(host)
        local_cvm.ensure_running(plan, FORWARDER_START_TIMEOUT)
        local_cvm.wait_role_listening(
            plan, "forwarder", plan.forwarder_ns, plan.forwarder_addr,
            host.definition.forwarder.listen.proxy_port, FORWARDER_START_TIMEOUT,
        )  # fmt: skip
    except LocalCvmError as exc:
        raise DevHostError(str(exc)) from None
    if supervise and local_cvm.running_pid(plan, SUPERVISOR) is None:
        _spawn_supervisor(host, definition)
    return status(host)


def _write_simulated_root(host: DevHost) -> None:
    """The release's simulated root (measured with it), where the forwarder reads its anchor."""
    pem, target = host.definition.simulated_root, host.definition.forwarder.simulated_root
    if pem is None or target is None:
        return
    from umbra.attest.simpki import cert_der

    der = cert_der(pem.encode())
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, der, 0o644)  # a public certificate, read by the dropped forwarder
    except OSError as exc:
        raise DevHostError(f"{target}: {exc.strerror}") from None


def _spawn_supervisor(host: DevHost, definition: Path) -> int:
    plan = host.plan
    log = (plan.dir / f"{SUPERVISOR}.log").open("ab")
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "UMBRA_LOCAL_CVM": plan.cvm_id,  # local_cvm.running_pid's marker
        "LANG": "C.UTF-8",
    }
    argv = [
        str(Path(sys.executable).parent / "umbra"), "sandbox", "host", "supervise",
        "--definition", str(definition), "--root", str(host.root),
        "--image-dir", str(host.image_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True,
        preexec_fn=_block_sigterm,
    )  # fmt: skip
    log.close()
    (plan.dir / f"{SUPERVISOR}.pid").write_text(str(proc.pid))
    return proc.pid


def _block_sigterm() -> None:
    """In the supervisor before its exec: SIGTERM blocked (the mask survives exec) until its
    handler is set, so a stop during its start (Python's imports take a minute on a loaded TCG
    vCPU) waits for the handler instead of killing it before it can stop the sandbox (seen: the
    boot after a reset, stopped 35 s after `started`, left the data volume held)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


class _Stopping(BaseException):
    """SIGTERM reached the supervisor: raised wherever it is, a restart's wait included
    (a BaseException, so no `except Exception` on the way swallows it)."""


def supervise(host: DevHost, interval: float = SUPERVISE_INTERVAL) -> None:
    """Until SIGTERM: restart whichever of the sandbox and the forwarder died. At SIGTERM it
    restarts nothing more and stops both before it exits. The sandbox's runc cgroup is not the
    launch agent's unit's, so systemd's stop of the unit (a CVM's stop) signals only this and the
    forwarder: the sandbox lived on and held the data volume, which then failed to unmount
    ("Failed unmounting var-lib-umbra-data.mount": the workspace's filesystem not cleanly
    closed), and the supervisor restarted the forwarder systemd had just stopped."""

    def stop(_sig: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop, however many signals
        raise _Stopping

    signal.signal(signal.SIGTERM, stop)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one sent at the start
        print("umbra-dev-host: supervising", flush=True)
        _use_image(host)
        while True:
            try:
                restarted = local_cvm.ensure_running(host.plan, FORWARDER_START_TIMEOUT)
                if restarted:
                    print(f"umbra-dev-host: restarted {', '.join(restarted)}", flush=True)
            except (LocalCvmError, OSError) as exc:
                print(f"umbra-dev-host: restart failed: {exc}", flush=True)
            time.sleep(interval)
    except _Stopping:
        print("umbra-dev-host: stopping: the sandbox and the forwarder", flush=True)
    local_cvm.shut_down(host.plan)
    print("umbra-dev-host: stopped", flush=True)


def down(host: DevHost) -> None:
    """Stop the supervisor first (it would restart the rest), then the processes and namespaces;
    the sandbox's files (its overlay upper layer, nested Docker's data) stay."""
    plan = host.plan
    pid = local_cvm.running_pid(plan, SUPERVISOR)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + 10
        while local_cvm.running_pid(plan, SUPERVISOR) is not None and time.monotonic() < end:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _use_image(host)
    local_cvm.shut_down(plan)


def status(host: DevHost) -> dict[str, Any]:
    plan = host.plan
    return {
        **local_cvm.status(plan),
        "release": host.definition.release,
        "supervisor_pid": local_cvm.running_pid(plan, SUPERVISOR),
        "sandbox_image": host.definition.sandbox_image.model_dump(),
    }
