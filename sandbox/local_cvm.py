"""A local Dev CVM: the cloud sandbox's isolation rebuilt from Linux namespaces on this machine.

    sandbox netns  {a}  ──veth──  {b}  forwarder netns  {c}  ──veth──  {d}  host
    10.231.N.2/30                 10.231.N.1/30         10.232.N.2/30        10.232.N.1/30

- The sandbox is the production sandbox image (sandbox/image.py) run by the production runtime
  (runc, sandbox/runtime.py): its own user (root maps to an unprivileged host uid range), mount,
  PID, UTS, IPC, cgroup and network namespaces. Its network namespace is runc's, owned by its user
  namespace (so its nested dockerd can make a bridge and NAT there); the host attaches the one
  veth to it between `runc create` and `runc start` (`attach_sandbox_network`) and names it
  `/run/netns/<prefix>-<id>-sbx`. The sandbox's root may change its own routes and rules: that
  gains nothing, because isolation is the topology on the forwarder's side.
- Its only link is the /30 to the forwarder; no default route, no IPv6.
- The forwarder namespace has ip_forward=0 and an nftables filter: from the sandbox link only the
  forwarder's own sandbox-side listeners are reachable (not its uplink address, not anything else),
  and nothing is ever forwarded. ip_nonlocal_bind=1 there: the forwarder's listeners bind the
  sandbox-side address even while the sandbox (and with it that address's link) is down or
  restarting. The forwarder (`umbra forwarder serve`) attests the Security CVM before passing a
  byte.
- Every sysctl that matters is set explicitly in every namespace we create or attach: a new
  namespace may inherit values from the host (Docker sets the host's ip_forward to 1).

Everything lives on disk under the CVM's directory (`plan.json`, pid files, logs, rootfs), so a
Console restart loses nothing; `destroy` kills the processes, deletes the namespaces (and with them
the veths) and removes the directory.

Why one module: the plan, the namespaces, the processes and the lifecycle of one local CVM share
the on-disk plan and the namespace and interface naming, and the isolation argument above must be
checked against all of it together."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from umbra.sandbox import image, runtime
from umbra.sandbox.render import CA_NAME
from umbra.sandbox.sandbox_env_sync import render as render_env

SANDBOX_PROXY_PORT = 3128
# The forwarder's other sandbox-side listeners: transparent HTTPS/HTTP (name from SNI / Host) and
# the sandbox's resolver (every name is the forwarder; docs/specs/sandbox.md).
SANDBOX_TRANSPARENT_HTTPS, SANDBOX_TRANSPARENT_HTTP, SANDBOX_DNS_PORT = 443, 80, 53
SANDBOX_TCP_PORTS = [
    SANDBOX_PROXY_PORT, SANDBOX_TRANSPARENT_HTTPS, SANDBOX_TRANSPARENT_HTTP, SANDBOX_DNS_PORT,
]  # fmt: skip
# The attested SSH ingress listens on the host end of the CVM's uplink (a per-CVM address, so
# every local CVM gets the same port without allocating one); the sandbox cannot reach it.
INGRESS_PORT = 2222
# The sandbox's login user (the ingress drops to it inside the sandbox's user namespace).
SANDBOX_USER_UID = 1000
SANDBOX_HOME = "/home/dev"
SANDBOX_SESSIONS = "/run/umbra-sessions"
DEV_CVM_IMAGE = "umbra-dev-cvm"
# The local Security CVM's tunnel endpoint: a /32 on the host end of every CVM's uplink veth (the
# kernel has no dummy interfaces in every container), so it is reachable from each forwarder
# namespace over its own uplink and on no other host interface.
SECURITY_CVM_ADDR = "10.232.0.1"
UID_BASE = 200_000
UID_COUNT = 65_536
MAX_CVMS = 250
# The forwarder drops host root to FORWARDER_UID_BASE + index once it has bound (below every
# sandbox's range, so no sandbox's root is the same host uid).
FORWARDER_UID_BASE = 150_000
# Where sessions and checks find their way: the proxy, NO_PROXY, every tool's CA variable.
NO_PROXY = "localhost,127.0.0.1,::1"
# Written by umbra-sandbox-init once the Security CVM's CA is in the system store.
CA_INSTALLED = "/run/umbra/ca-installed"


class LocalCvmError(Exception):
    """A local CVM could not be created, started or destroyed; the message says why."""


@dataclass(frozen=True)
class LocalCvmPlan:
    cvm_id: str
    index: int
    prefix: str
    directory: str
    uid: int

    @property
    def dir(self) -> Path:
        return Path(self.directory)

    @property
    def short(self) -> str:
        return self.cvm_id.removeprefix("cvm_")[:8]

    @property
    def sandbox_ns(self) -> str:
        return f"{self.prefix}-{self.short}-sbx"

    @property
    def forwarder_ns(self) -> str:
        return f"{self.prefix}-{self.short}-fwd"

    def ifname(self, role: str) -> str:
        return f"{self.prefix}{self.index}{role}"[-15:]

    @property
    def sandbox_addr(self) -> str:
        return f"10.231.{self.index}.2"

    @property
    def forwarder_addr(self) -> str:
        """The forwarder's sandbox-side address: the only one the sandbox can reach."""
        return f"10.231.{self.index}.1"

    @property
    def uplink_addr(self) -> str:
        return f"10.232.{self.index}.2"

    @property
    def host_addr(self) -> str:
        """The host end of the uplink: where the forwarder reaches the Security CVM."""
        return f"10.232.{self.index}.1"

    @property
    def rootfs(self) -> Path:
        """The sandbox's tree as the host sees it (the mounted overlay, while it runs)."""
        return runtime.RUN_ROOT / self.cvm_id / "rootfs"

    @property
    def forwarder_uid(self) -> int:
        """The unprivileged host uid (= gid) the forwarder runs as once it has bound."""
        return FORWARDER_UID_BASE + self.index

    @property
    def proxy_url(self) -> str:
        return f"http://{self.forwarder_addr}:{SANDBOX_PROXY_PORT}"

    @property
    def launch_dir(self) -> Path:
        """What the attested SSH ingress needs (`umbra sandbox ingress --config`)."""
        return self.dir / "launch"

    @property
    def ingress_config(self) -> Path:
        return self.dir / "ingress.json"


# ----------------------------------------------------------------------------- commands


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise LocalCvmError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def _sysctl(ns: str, key: str, value: str) -> None:
    _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}")


def _netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def require_tools() -> None:
    """Root and the commands the local provider drives; one message naming what is missing."""
    if os.geteuid() != 0:
        raise LocalCvmError("local CVMs need root (network and user namespaces): run as root")
    missing = [tool for tool in ("ip", "nft", "nsenter", "sysctl") if shutil.which(tool) is None]
    if missing:
        raise LocalCvmError(
            f"missing commands: {', '.join(missing)}; run ./scripts/system-deps as root"
        )
    try:
        runtime.require_runtime()
    except runtime.RuntimeError_ as exc:
        raise LocalCvmError(str(exc)) from None


# ----------------------------------------------------------------------------- plan


def allocate(root: Path, cvm_id: str, prefix: str) -> LocalCvmPlan:
    """A plan with the lowest free subnet index among the CVMs under `root` (on disk)."""
    root.mkdir(parents=True, exist_ok=True)
    # Launches may run in parallel (the Console's provisioning jobs): one allocation at a time.
    with (root / ".allocate.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _allocate_locked(root, cvm_id, prefix)


def _allocate_locked(root: Path, cvm_id: str, prefix: str) -> LocalCvmPlan:
    used = {plan.index for plan in all_plans(root)} | _host_indices_in_use()
    index = next((i for i in range(1, MAX_CVMS) if i not in used), None)
    if index is None:
        raise LocalCvmError(f"no free local subnet: {MAX_CVMS - 1} local CVMs exist")
    directory = root / cvm_id
    plan = LocalCvmPlan(cvm_id, index, prefix, str(directory), UID_BASE + index * UID_COUNT)
    directory.mkdir(mode=0o700)
    (directory / "plan.json").write_text(json.dumps(asdict(plan)))
    return plan


def _host_indices_in_use() -> set[int]:
    """Uplink subnets some other state directory (or a leftover) already uses on this host."""
    shown = _run("ip", "-4", "-o", "addr", "show", check=False).stdout
    used = set()
    for word in shown.split():
        if word.startswith("10.232.") and word.count(".") == 3:
            used.add(int(word.split(".")[2]))
    return used


def load_plan(root: Path, cvm_id: str) -> LocalCvmPlan | None:
    try:
        return LocalCvmPlan(**json.loads((root / cvm_id / "plan.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def all_plans(root: Path) -> list[LocalCvmPlan]:
    if not root.is_dir():
        return []
    plans = [load_plan(root, child.name) for child in sorted(root.iterdir())]
    return [plan for plan in plans if plan is not None]


# ----------------------------------------------------------------------------- network


def _nft_rules(plan: LocalCvmPlan, ports: list[int]) -> str:
    return forwarder_filter(plan.ifname("b"), plan.forwarder_addr, ports, [SANDBOX_DNS_PORT])


def forwarder_filter(
    sandbox_if: str, forwarder_addr: str, tcp_ports: list[int], udp_ports: list[int]
) -> str:
    """The forwarder namespace's nftables: from the sandbox link only the forwarder's own
    sandbox-side TCP listeners and its DNS responder (UDP 53, which never sends a query on)."""
    tcp_set = ", ".join(str(p) for p in sorted(set(tcp_ports)))
    udp_rule = ""
    if udp_ports:
        udp_set = ", ".join(str(p) for p in sorted(set(udp_ports)))
        udp_rule = f'\n    iifname "{sandbox_if}" ip daddr {forwarder_addr} udp dport {{ {udp_set} }} accept'
    return f"""table inet umbra_local {{
  chain input {{
    type filter hook input priority 0; policy accept;
    iifname "{sandbox_if}" ip daddr {forwarder_addr} tcp dport {{ {tcp_set} }} ct state new,established accept{udp_rule}
    iifname "{sandbox_if}" drop
  }}
  chain forward {{
    type filter hook forward priority 0; policy drop;
  }}
}}
"""


# Per namespace, whatever the host's values (Docker sets the host's ip_forward to 1).
_NS_SYSCTLS = (
    ("net.ipv4.ip_forward", "0"),
    ("net.ipv6.conf.all.forwarding", "0"),
    ("net.ipv6.conf.all.disable_ipv6", "1"),
    ("net.ipv6.conf.default.disable_ipv6", "1"),
    ("net.ipv4.conf.all.accept_redirects", "0"),
    ("net.ipv4.conf.all.send_redirects", "0"),
    ("net.ipv4.conf.all.rp_filter", "1"),
    ("net.ipv4.conf.default.rp_filter", "1"),
)
# The forwarder binds its sandbox-side address before (and while) the sandbox's link exists.
_FORWARDER_SYSCTLS = (*_NS_SYSCTLS, ("net.ipv4.ip_nonlocal_bind", "1"))


def create_network(plan: LocalCvmPlan, forwarder_ports: list[int]) -> None:
    """The forwarder's namespace, its uplink veth to the host, sysctls and filter. The sandbox's
    side comes with each start of the sandbox (`attach_sandbox_network`)."""
    if _netns_exists(plan.forwarder_ns):
        raise LocalCvmError(f"network namespace {plan.forwarder_ns} already exists (stale state?)")
    ns = plan.forwarder_ns
    _run("ip", "netns", "add", ns)
    _run("ip", "-n", ns, "link", "set", "lo", "up")
    for key, value in _FORWARDER_SYSCTLS:
        _sysctl(ns, key, value)
    c, d = plan.ifname("c"), plan.ifname("d")
    _run("ip", "link", "add", c, "netns", ns, "type", "veth", "peer", "name", d)
    _run("ip", "-n", ns, "addr", "add", f"{plan.uplink_addr}/30", "dev", c)
    _run("ip", "addr", "add", f"{plan.host_addr}/30", "dev", d)
    _run("ip", "addr", "add", f"{SECURITY_CVM_ADDR}/32", "dev", d)
    _run("ip", "-n", ns, "link", "set", c, "up")
    _run("ip", "link", "set", d, "up")
    _run("ip", "-n", ns, "route", "add", f"{SECURITY_CVM_ADDR}/32", "dev", c)
    rules = _nft_rules(plan, forwarder_ports)
    subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "-f", "-"],
        input=rules, text=True, check=True, capture_output=True, timeout=30,
    )  # fmt: skip


def attach_sandbox_network(plan: LocalCvmPlan, pid: int) -> None:
    """Wire a created (not yet started) sandbox: name its network namespace (the one runc made,
    owned by the sandbox's user namespace) `plan.sandbox_ns`, and give it its one link, a veth to
    the forwarder's namespace, with its address and sysctls. A previous run's namespace and link
    are removed first (a veth dies with its namespace's last process, but a name keeps it)."""
    if not _netns_exists(plan.forwarder_ns):
        raise LocalCvmError(f"the forwarder namespace {plan.forwarder_ns} does not exist")
    detach_sandbox_network(plan)
    a, b = plan.ifname("a"), plan.ifname("b")
    _run("ip", "netns", "attach", plan.sandbox_ns, str(pid))
    ns = plan.sandbox_ns
    _run("ip", "-n", ns, "link", "set", "lo", "up")
    for key, value in _NS_SYSCTLS:
        _sysctl(ns, key, value)
    _run(
        "ip", "link", "add", a, "netns", ns,
        "type", "veth", "peer", "name", b, "netns", plan.forwarder_ns,
    )  # fmt: skip
    _sysctl(ns, f"net.ipv6.conf.{a}.disable_ipv6", "1")
    _sysctl(plan.forwarder_ns, f"net.ipv6.conf.{b}.disable_ipv6", "1")
    _run("ip", "-n", ns, "addr", "add", f"{plan.sandbox_addr}/30", "dev", a)
    _run("ip", "-n", plan.forwarder_ns, "addr", "add", f"{plan.forwarder_addr}/30", "dev", b)
    _run("ip", "-n", ns, "link", "set", a, "up")
    _run("ip", "-n", plan.forwarder_ns, "link", "set", b, "up")


def detach_sandbox_network(plan: LocalCvmPlan) -> None:
    """Drop the sandbox namespace's name and the link to the forwarder (idempotent)."""
    if _netns_exists(plan.forwarder_ns):
        _run("ip", "-n", plan.forwarder_ns, "link", "del", plan.ifname("b"), check=False)
    if _netns_exists(plan.sandbox_ns):
        _run("ip", "netns", "del", plan.sandbox_ns, check=False)


def delete_network(plan: LocalCvmPlan) -> None:
    # The host end first: a namespace's deletion (and so its veths') completes asynchronously.
    _run("ip", "link", "del", plan.ifname("d"), check=False)
    detach_sandbox_network(plan)
    if _netns_exists(plan.forwarder_ns):
        _run("ip", "netns", "del", plan.forwarder_ns, check=False)


# ----------------------------------------------------------------------------- processes


def _pid_file(plan: LocalCvmPlan, role: str) -> Path:
    return plan.dir / f"{role}.pid"


def _marker(plan: LocalCvmPlan) -> str:
    return f"umbra-local-cvm={plan.cvm_id}"


def running_pid(plan: LocalCvmPlan, role: str) -> int | None:
    """The pid of this CVM's `role` process if it is alive and really ours (checked by marker)."""
    try:
        pid = int(_pid_file(plan, role).read_text())
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except (OSError, ValueError):
        return None
    if f"UMBRA_LOCAL_CVM={plan.cvm_id}\0".encode() not in environ + b"\0":
        return None
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return None
    return pid


def _spawn(plan: LocalCvmPlan, role: str, argv: list[str]) -> int:
    log = (plan.dir / f"{role}.log").open("ab")
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "UMBRA_LOCAL_CVM": plan.cvm_id,
        "LANG": "C.UTF-8",
    }
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True
    )
    log.close()
    _pid_file(plan, role).write_text(str(proc.pid))
    # Until it has exec'd, the child still shows its parent's environment (without the marker).
    end = time.monotonic() + 10
    while running_pid(plan, role) is None and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.01)
    return proc.pid


def umbra_executable() -> str:
    return str(Path(sys.executable).parent / "umbra")


def start_forwarder(plan: LocalCvmPlan) -> int:
    return _spawn(
        plan,
        "forwarder",
        [
            "ip", "netns", "exec", plan.forwarder_ns,
            umbra_executable(), "forwarder", "serve", "-c", str(plan.dir / "forwarder.json"),
            "--run-as", str(plan.forwarder_uid),
        ],
    )  # fmt: skip


def sandbox_env_base(plan: LocalCvmPlan) -> dict[str, str]:
    """This CVM's own sandbox variables (the proxy, NO_PROXY, every tool's CA variable)."""
    pairs = [
        (k, plan.proxy_url) for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
    ]
    pairs += [("NO_PROXY", NO_PROXY), ("no_proxy", NO_PROXY)]
    pairs += [(k, image.CA_BUNDLE) for k in image.CA_VARS]
    return dict(pairs)


def sandbox_env_config(plan: LocalCvmPlan) -> dict[str, Any]:
    """The forwarder's `sandbox_env` (forwarder_config.SandboxEnv) for this sandbox, `umbra up`'s
    and a cloud Dev CVM's alike: the file in the directory bound read-only at ENV_DIR, and the
    same base the sandbox's start renders (so the two never disagree about the CVM's values)."""
    return {"file": str(plan.dir / "sandbox-etc" / "sandbox.env"), "base": sandbox_env_base(plan)}


def sandbox_env(plan: LocalCvmPlan) -> str:
    """`/etc/umbra/sandbox.env` at the sandbox's start: this CVM's own values; the forwarder
    adds the attached profiles' `sandbox_env` within seconds (sandbox_env_sync.py)."""
    return render_env(sandbox_env_base(plan), {})


def resolv_conf(plan: LocalCvmPlan) -> str:
    """The sandbox's resolver: the forwarder's sandbox-side address, the only one it can reach
    (its DNS responder is the sandbox-egress part of #21; until it listens, lookups fail fast)."""
    return f"nameserver {plan.forwarder_addr}\noptions timeout:2 attempts:1\n"


def sandbox_spec(plan: LocalCvmPlan, layers: tuple[Path, ...] | None = None) -> runtime.SandboxSpec:
    """The runtime's view of this CVM's sandbox (`layers`: the cached image; looked up if None)."""
    if layers is None:
        layers = image.cached_layers()
        if layers is None:
            raise LocalCvmError(
                "the sandbox image is not built: `umbra up` builds it (once per machine)"
            )
    init = [
        "/usr/bin/tini", "--", "/usr/local/bin/umbra-sandbox-init",
        "--sessions", SANDBOX_SESSIONS, "--ca", f"{image.CA_DIR}/{CA_NAME}", "--ca-wait", "0",
        "--env-dir", image.ENV_DIR,
    ]  # fmt: skip
    return runtime.SandboxSpec(
        name=plan.cvm_id,
        base_uid=plan.uid,
        netns=None,  # runc's, owned by the sandbox's user namespace: attach_sandbox_network
        image=layers,
        upper=plan.dir / "upper",
        work=plan.dir / "overlay-work",
        state=plan.dir / "runc",
        args=tuple(init),
        env=(f"UMBRA_LOCAL_CVM={plan.cvm_id}",),
        binds=(
            runtime.Bind(plan.dir / "docker", "/var/lib/docker", read_only=False),
            runtime.Bind(plan.dir / "sandbox-ca", image.CA_DIR),
            runtime.Bind(plan.dir / "sandbox-etc", image.ENV_DIR),
        ),
    )


def _prepare_sandbox_dirs(plan: LocalCvmPlan) -> None:
    """The host-side directories bound into the sandbox (made at every start: idempotent)."""
    docker = plan.dir / "docker"  # ext4 under the CVM's directory: overlay2 needs it
    docker.mkdir(mode=0o710, exist_ok=True)
    os.chown(docker, plan.uid, plan.uid)
    (plan.dir / "sandbox-ca").mkdir(mode=0o755, exist_ok=True)
    etc = plan.dir / "sandbox-etc"
    etc.mkdir(mode=0o755, exist_ok=True)
    (etc / "sandbox.env").write_text(sandbox_env(plan))
    (etc / "resolv.conf").write_text(resolv_conf(plan))
    for name in ("sandbox.env", "resolv.conf"):
        (etc / name).chmod(0o644)


def start_sandbox(plan: LocalCvmPlan) -> int:
    """The sandbox container; its init's host pid (tini's) is what `nsenter` targets."""
    spec = sandbox_spec(plan)
    _prepare_sandbox_dirs(plan)
    try:
        pid = runtime.start(
            spec,
            _pid_file(plan, "sandbox"),
            on_created=lambda pid: attach_sandbox_network(plan, pid),
        )
    except (runtime.RuntimeError_, LocalCvmError, OSError) as exc:
        raise LocalCvmError(f"the sandbox of {plan.cvm_id} did not start: {exc}") from None
    # `runc start` returns before its init has exec'd tini (and shows our marker).
    end = time.monotonic() + 10
    while running_pid(plan, "sandbox") is None:
        if time.monotonic() > end:
            log = (plan.dir / "runc" / "init.log").read_text(errors="replace")[-500:]
            raise LocalCvmError(f"the sandbox of {plan.cvm_id} exited at start: {log.strip()}")
        time.sleep(0.01)
    return pid


def stop_sandbox(plan: LocalCvmPlan) -> None:
    """Kill the container (every process in it) and unmount its tree; its files stay."""
    spec = sandbox_spec(plan, layers=())
    if (plan.dir / "runc").exists():
        with contextlib.suppress(runtime.RuntimeError_):
            runtime.delete(spec)
    runtime.unmount_rootfs(spec)
    detach_sandbox_network(plan)


def _listens(table: str, host: str, port: int) -> bool:
    """Whether a /proc/net/tcp table has `host:port` in LISTEN."""
    want = "".join(f"{int(x):02X}" for x in reversed(host.split("."))) + f":{port:04X}"
    return any(
        len(cols := line.split()) > 3 and cols[1] == want and cols[3] == "0A"
        for line in table.splitlines()[1:]
    )


def wait_role_listening(
    plan: LocalCvmPlan, role: str, ns: str | None, host: str, port: int, timeout: float
) -> None:
    """Until `role`'s process listens on `host:port` in namespace `ns` (None: ours). Fails at
    once, with its log's tail, when the process exits first: a forwarder whose enrollment was
    refused is not waited out. It reads the process's /proc/PID/net/tcp, spawning nothing: on a
    Dev CVM's one vCPU under TCG, the former poll's `ip netns exec` ten times a second took CPU
    from the very forwarder it waited for. The table counts once the process is in `ns` (it
    starts as `ip netns exec`, in ours)."""
    try:
        want = os.stat(f"/run/netns/{ns}" if ns else "/proc/self/ns/net").st_ino
    except OSError as exc:
        raise LocalCvmError(f"no network namespace {ns} for the {role}: {exc.strerror}") from None
    end = time.monotonic() + timeout
    while True:
        pid = running_pid(plan, role)
        try:
            inside = pid is not None and os.stat(f"/proc/{pid}/ns/net").st_ino == want
            table = Path(f"/proc/{pid}/net/tcp").read_text() if inside else ""
        except OSError:
            table, pid = "", None
        if pid is None:
            raise LocalCvmError(
                f"the {role} of {plan.cvm_id} exited before it listened on {host}:{port}: "
                f"{_log_tail(plan, role)}"
            )
        if _listens(table, host, port):
            return
        if time.monotonic() >= end:
            raise LocalCvmError(
                f"the {role} of {plan.cvm_id} runs but does not listen on {host}:{port} "
                f"after {timeout:.0f}s: {_log_tail(plan, role)}"
            )
        time.sleep(0.25)


def _log_tail(plan: LocalCvmPlan, role: str) -> str:
    try:
        tail = (plan.dir / f"{role}.log").read_text(errors="replace")[-500:].strip()
    except OSError:
        return "(no log)"
    return tail or "(its log is empty)"


def stop(plan: LocalCvmPlan, role: str) -> None:
    if role == "sandbox":
        stop_sandbox(plan)
        return
    pid = running_pid(plan, role)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        # Groups: `ip netns exec` forks the forwarder; the ingress's sshd -i children go with it.
        if role in ("forwarder", "ingress"):
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 5
    while time.monotonic() < end and Path(f"/proc/{pid}").exists():
        if Path(f"/proc/{pid}/stat").exists():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        time.sleep(0.02)


# ----------------------------------------------------------------------------- lifecycle


def write_launch_dir(plan: LocalCvmPlan, authorized_keys: list[str]) -> None:
    """What the attested SSH ingress (`umbra sandbox ingress --config`) will need: the lead wires
    its start in `start_ingress`."""
    launch = plan.launch_dir
    launch.mkdir(mode=0o700, exist_ok=True)
    (launch / "cvm-id").write_text(plan.cvm_id + "\n")
    (launch / "authorized_keys").write_text("".join(k.strip() + "\n" for k in authorized_keys))
    (launch / "netns").write_text(plan.forwarder_ns + "\n")
    sessions = plan.rootfs / SANDBOX_SESSIONS.lstrip("/")
    (launch / "sessions-dir").write_text(str(sessions) + "\n")
    pid = running_pid(plan, "sandbox")
    (launch / "sandbox-pid").write_text(f"{pid or ''}\n")


def write_ingress_config(plan: LocalCvmPlan, simulated_pki: Path) -> None:
    """`umbra sandbox ingress`'s config for this CVM, from its launch directory.

    The simulated TD's PKI signs its quotes; the host key is generated at first start in
    `gateway/` (root 0700, inside the CVM's directory, never visible to the sandbox) and bound
    into RTMR3 with the CVM id and the authorized-keys digest, as the ingress does everywhere."""
    config = {
        "listen": {"host": plan.host_addr, "port": INGRESS_PORT},
        "launch_dir": str(plan.launch_dir),
        "state_dir": str(plan.dir / "gateway"),
        "sandbox": {
            # Read per session: a restarted sandbox is found again without restarting us.
            "pid_file": str(_pid_file(plan, "sandbox")),
            "uid": SANDBOX_USER_UID,
            "gid": SANDBOX_USER_UID,
            "home": SANDBOX_HOME,
            "sessions_dir": SANDBOX_SESSIONS,
        },
        "quote_source": {
            "kind": "simulated",
            "simulated_pki": str(simulated_pki),
            "simulated_image": DEV_CVM_IMAGE,
        },
    }
    plan.ingress_config.write_text(json.dumps(config, indent=2))


def ssh_ingress(plan: LocalCvmPlan) -> dict[str, Any] | None:
    """Where the client reaches the ingress (`provider_state.ssh_ingress`), if it has one."""
    if not plan.ingress_config.exists():
        return None
    return {"host": plan.host_addr, "port": INGRESS_PORT}


def start_ingress(plan: LocalCvmPlan) -> int | None:
    """THE place where a local CVM starts its attested SSH ingress (aTLS + gateway sshd), when
    `write_ingress_config` gave it one. Returns its pid once it listens."""
    if not plan.ingress_config.exists():
        return None
    pid = _spawn(
        plan,
        "ingress",
        [umbra_executable(), "sandbox", "ingress", "--config", str(plan.ingress_config)],
    )
    try:
        wait_role_listening(plan, "ingress", None, plan.host_addr, INGRESS_PORT, timeout=30)
    except LocalCvmError as exc:
        stop(plan, "ingress")
        raise LocalCvmError(f"the SSH ingress did not start: {exc}") from None
    return pid


def restart_ingress(plan: LocalCvmPlan) -> None:
    """After the launch keys changed: the ingress binds them into its quotes at start."""
    stop(plan, "ingress")
    start_ingress(plan)


def ensure_running(plan: LocalCvmPlan, forwarder_wait: float = 60) -> list[str]:
    """Restart whichever of the CVM's processes died; returns the roles restarted.
    `forwarder_wait`: how long a started forwarder may take to listen (it enrolls first)."""
    restarted = []
    if running_pid(plan, "sandbox") is None:
        start_sandbox(plan)
        restarted.append("sandbox")
    if running_pid(plan, "forwarder") is None:
        start_forwarder(plan)
        wait_role_listening(
            plan, "forwarder", plan.forwarder_ns, plan.forwarder_addr, SANDBOX_PROXY_PORT,
            forwarder_wait,
        )  # fmt: skip
        restarted.append("forwarder")
    if plan.ingress_config.exists() and running_pid(plan, "ingress") is None:
        start_ingress(plan)
        restarted.append("ingress")
    return restarted


def ensure_network(plan: LocalCvmPlan) -> bool:
    """Recreate the forwarder's namespace after `shut_down` (or a reboot); True when it had to.
    (The sandbox's comes with the sandbox: `start_sandbox`.)"""
    if _netns_exists(plan.forwarder_ns):
        return False
    for role in ("ingress", "forwarder", "sandbox"):
        stop(plan, role)
    delete_network(plan)
    create_network(plan, SANDBOX_TCP_PORTS)
    return True


def shut_down(plan: LocalCvmPlan) -> None:
    """Stop the CVM's processes and remove its namespaces and veths; keep its files."""
    for role in ("ingress", "forwarder", "sandbox"):
        stop(plan, role)
    delete_network(plan)


def create(
    root: Path,
    cvm_id: str,
    prefix: str,
    forwarder_config: dict[str, Any],
    enrollment_token: str,
    authorized_keys: list[str],
    simulated_pki: Path | None = None,
) -> LocalCvmPlan:
    """Build and start a local Dev CVM; on any failure remove everything it had made. With
    `simulated_pki`, its attested SSH ingress runs on that simulated TEE.

    Its launch data carries only the one-time enrollment token (`launch/enrollment-token`, as the
    image's launch agent writes `/run/umbra/launch/enrollment-token`); its tunnel credential comes
    from enrolling (`forwarder_config["enrollment"]` says where the Console is), and a refused
    enrollment is this launch's failure, with the Console's reason."""
    require_tools()
    plan = allocate(root, cvm_id, prefix)
    taken = [ns for ns in (plan.sandbox_ns, plan.forwarder_ns) if _netns_exists(ns)]
    if taken:
        # Not ours: refuse without touching it (cleanup below would delete it by name).
        shutil.rmtree(plan.dir, ignore_errors=True)
        raise LocalCvmError(f"network namespace {taken[0]} already exists; remove it or rename")
    try:
        (plan.dir / "cvm-id").write_text(cvm_id + "\n")
        plan.launch_dir.mkdir(mode=0o700, exist_ok=True)
        token_path = plan.launch_dir / "enrollment-token"
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(enrollment_token + "\n")
        config = dict(forwarder_config)
        config["listen"] = {
            "host": plan.forwarder_addr,
            "proxy_port": SANDBOX_PROXY_PORT,
            "tunnels": [],
            "transparent": {
                "https_port": SANDBOX_TRANSPARENT_HTTPS,
                "http_port": SANDBOX_TRANSPARENT_HTTP,
            },
            "dns_port": SANDBOX_DNS_PORT,
        }
        config["security_cvm"] = {**config["security_cvm"], "host": SECURITY_CVM_ADDR}
        config["cvm_id_file"] = str(plan.dir / "cvm-id")
        config["credential_file"] = str(plan.dir / "credential")
        config["enrollment"] = {**config["enrollment"], "token_file": str(token_path)}
        # The interception CA, fetched by the forwarder inside its attested session and bound
        # read-only into the sandbox, as in the cloud (sandbox_ca.py, umbra-sandbox-init).
        config["sandbox_ca"] = {"file": str(plan.dir / "sandbox-ca" / CA_NAME)}
        # The attached profiles' `sandbox_env`, asked of the Security CVM the same way.
        config["sandbox_env"] = sandbox_env_config(plan)
        (plan.dir / "forwarder.json").write_text(json.dumps(config, indent=2))
        enroll(plan)
        create_network(plan, SANDBOX_TCP_PORTS)
        ensure_running(plan)
        write_launch_dir(plan, authorized_keys)
        if simulated_pki is not None:
            write_ingress_config(plan, simulated_pki)
        start_ingress(plan)
    except BaseException:
        destroy(plan)
        raise
    return plan


def enroll(plan: LocalCvmPlan) -> None:
    """`umbra forwarder enroll`, on the host side: the Console listens on loopback, which the
    forwarder's namespace cannot reach. The process is this CVM's simulated TD: it generates the
    key, quotes it with the CVM id and keeps the sealed credential (0600)."""
    argv = [umbra_executable(), "forwarder", "enroll", "-c", str(plan.dir / "forwarder.json")]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "NO_COLOR": "1"}
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=90, env=env, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise LocalCvmError(f"enrollment of {plan.cvm_id} did not finish within 90 s") from None
    if done.returncode != 0:
        reason = " ".join((done.stderr or done.stdout).split()).removeprefix("error ")
        raise LocalCvmError(f"enrollment failed: {reason[-400:]}")


def destroy(plan: LocalCvmPlan) -> None:
    shut_down(plan)
    shutil.rmtree(plan.dir, ignore_errors=True)


def status(plan: LocalCvmPlan) -> dict[str, Any]:
    return {
        "cvm_id": plan.cvm_id,
        "runtime": "runc",
        "sandbox_pid": running_pid(plan, "sandbox"),
        "forwarder_pid": running_pid(plan, "forwarder"),
        "ingress_pid": running_pid(plan, "ingress"),
        "ssh_ingress": ssh_ingress(plan),
        "sandbox_netns": plan.sandbox_ns if _netns_exists(plan.sandbox_ns) else None,
        "forwarder_netns": plan.forwarder_ns if _netns_exists(plan.forwarder_ns) else None,
        "proxy": f"http://{plan.forwarder_addr}:{SANDBOX_PROXY_PORT}",
    }


def exec_argv(plan: LocalCvmPlan, command: list[str]) -> list[str]:
    """Run `command` inside the sandbox, as its root (an unprivileged uid on the host)."""
    pid = running_pid(plan, "sandbox")
    if pid is None:
        raise LocalCvmError(f"the sandbox of {plan.cvm_id} is not running")
    return ["nsenter", "-t", str(pid), "-U", "-m", "-n", "-p", "-i", "-u", "-C", "-r", "-w", "--",
            *command]  # fmt: skip


def _passwd_entry(plan: LocalCvmPlan, user: str) -> tuple[int, int, str]:
    """(uid, gid, home) of `user` in the sandbox's own /etc/passwd."""
    try:
        lines = (plan.rootfs / "etc/passwd").read_text().splitlines()
    except OSError as exc:
        raise LocalCvmError(f"cannot read the sandbox's /etc/passwd: {exc.strerror}") from None
    for line in lines:
        fields = line.split(":")
        if len(fields) >= 7 and fields[0] == user and fields[2].isdigit() and fields[3].isdigit():
            return int(fields[2]), int(fields[3]), fields[5]
    raise LocalCvmError(f"the sandbox has no user {user!r}")


def run_argv(plan: LocalCvmPlan, argv: list[str], user: str = "dev") -> list[str]:
    """The host argv that runs `argv` in the sandbox as `user` in a login shell's environment
    (/etc/profile, profile.d: the proxy, the CA variables, ~/.local/bin), as a session does."""
    uid, gid, home = _passwd_entry(plan, user)
    pid = running_pid(plan, "sandbox")
    if pid is None:
        raise LocalCvmError(f"the sandbox of {plan.cvm_id} is not running")
    return [
        "nsenter", "-t", str(pid), "-U", "-m", "-n", "-p", "-i", "-u", "-C", "-r",
        f"--wdns={home}", "--setuid", str(uid), "--setgid", str(gid), "--",
        "/usr/bin/env", "-i", f"HOME={home}", f"USER={user}", f"LOGNAME={user}",
        "SHELL=/bin/bash", "LANG=C.UTF-8", "TERM=dumb",
        "PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin",
        "/bin/bash", "-lc", 'exec "$@"', "umbra-run", *argv,
    ]  # fmt: skip


def run_in_sandbox(
    plan: LocalCvmPlan,
    argv: list[str],
    user: str = "dev",
    timeout: float = 60,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `argv` in the sandbox as `user` with the login environment; a timeout is an error
    naming the command (its process group is killed)."""
    try:
        return subprocess.run(
            run_argv(plan, argv, user),
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise LocalCvmError(
            f"`{' '.join(argv)}` in the sandbox of {plan.cvm_id} ran over {timeout:.0f} s"
        ) from None
