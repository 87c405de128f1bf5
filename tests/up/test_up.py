"""`umbra up` end to end, as a user runs it: real processes, real namespaces, a real Console,
proxy, forwarder and sandbox; then the faults, and `umbra down` leaving nothing behind.

Everything is named with a prefix unique to this test run (namespaces, veths) and lives in a temp
state directory with its own ports, so it runs beside other users of the machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import secrets
import select
import shutil
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.sandbox.login_shells import LOGIN_SHELLS, login_shells_see, pam_env_assignments
from tests.session.harness import simulated_pki, stop_agents
from umbra.attest.simulator import simulated_boot_values
from umbra.cli import up_stack
from umbra.sandbox import image, local_cvm

ROOT = Path(__file__).resolve().parents[2]
UMBRA = ROOT / ".venv" / "bin" / "umbra"


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("umbra up needs root (namespaces); CI runs as root")
    missing = [t for t in up_stack.REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"missing {missing}: scripts/system-deps installs them")


def _free_base() -> int:
    """Six consecutive free loopback ports."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = int(sock.getsockname()[1])
        if base > 60000:
            continue
        ok = True
        for offset in range(6):
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", base + offset))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no five free consecutive ports")


@dataclass
class Up:
    state: Path
    base: int
    prefix: str
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [str(UMBRA), *args, "--state-dir", str(self.state), "--port-base", str(self.base)],
                capture_output=True,
                text=True,
                env=self.env,
                cwd=ROOT,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            # Say where it stood: its output so far and what each component logged.
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
            raise AssertionError(
                f"umbra {' '.join(args)} ran over {timeout:.0f}s; output so far: {out[-1500:]!r}"
                f"\n{self.logs()}"
            ) from None

    def logs(self, chars: int = 1500) -> str:
        """The tails of every component's log (the Console's, the proxy's, each Dev CVM's
        forwarder and ingress): why a connection was refused is logged there."""
        files = sorted((self.state / "logs").glob("*.log")) + sorted(
            (self.state / "cvms").glob("*/*.log")
        )
        tails = []
        for path in files:
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace")[-chars:]
                tails.append(f"--- {path.relative_to(self.state)}\n{text}")
        return "\n".join(tails)

    def json(self, *args: str) -> dict[str, Any]:
        done = self.run(*args, "--json")
        assert done.stdout, done.stderr
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    def client(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """The developer's CLI (no --state-dir: it finds its Console through the login)."""
        return subprocess.run(
            [str(UMBRA), *args], capture_output=True, text=True, env=env or self.env, timeout=90
        )

    def stack(self) -> up_stack.Stack:
        stack = up_stack.Stack(self.state, self.base)
        stack.load()
        return stack


def _leftovers(up: Up) -> list[str]:
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [line for line in netns.splitlines() if line.startswith(up.prefix)]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found += [line.split(":")[1].strip() for line in links.splitlines() if up.prefix in line]
    markers = {f"UMBRA_UP_STATE={up.state}".encode()} | {
        f"UMBRA_LOCAL_CVM={plan.cvm_id}".encode() for plan in local_cvm.all_plans(up.state / "cvms")
    }
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if environ & markers:
            found.append(f"process {proc.name}")
    mounts = Path("/proc/self/mountinfo").read_text()
    found += [line for line in mounts.splitlines() if str(up.state) in line]
    for plan in local_cvm.all_plans(up.state / "cvms"):
        found += [
            line for line in mounts.splitlines() if f"/run/umbra-sandbox/{plan.cvm_id}" in line
        ]
        if (Path("/run/umbra-sandbox") / plan.cvm_id).exists():
            found.append(f"runtime dir of {plan.cvm_id}")
        if any((plan.dir / "runc").glob("*/state.json")):
            found.append(f"runc container {plan.cvm_id}")
    return found


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    _require_root()
    # The sandbox image, built once per machine (minutes on a fresh one), outside `umbra up`'s
    # per-command timeout; every later `up` here and in tests/sandbox/ reuses the cache.
    image.ensure_image()
    tmp = tmp_path_factory.mktemp("up")
    prefix = f"uup{os.getpid() % 100000}"
    (tmp / "home").mkdir()  # no ~/.ssh: `umbra up` makes a dedicated key under its state dir
    (tmp / "t").mkdir()
    env = {
        **os.environ,
        "HOME": str(tmp / "home"),
        "TMPDIR": str(tmp / "t"),
        "XDG_CONFIG_HOME": str(tmp / "config"),
        "UMBRA_UP_NAME_PREFIX": prefix,
        "NO_COLOR": "1",
        "COLUMNS": "200",
    }
    for opt_in in ("UMBRA_STATE_DIR", "UMBRA_SIMULATED_PKI", "UMBRA_SSH_IDENTITY"):
        env.pop(opt_in, None)  # `umbra up` must set up the client's opt-ins itself
    handle = Up(tmp / "state", _free_base(), prefix, env)
    try:
        yield handle
    finally:
        stop_agents(tmp / "t")
        handle.run("down")
        for plan in local_cvm.all_plans(handle.state / "cvms"):
            local_cvm.shut_down(plan)


def test_up_check_from_clean_state_shows_the_four_records(up: Up) -> None:
    result = up.json("up", "--check")
    assert result["ok"], result
    cvm = result["dev_cvm_id"]
    records = result["check"]["records"]
    got = {(r["method"], r["connect_host"], r["decision"]) for r in records}
    assert got >= {
        ("GET", "api.demo.test", "allow"),
        ("GET", "evil.demo.test", "deny"),
        ("DELETE", "api.demo.test", "deny"),
        ("POST", "api.demo.test", "deny"),
    }
    assert {r["cvm_id"] for r in records} == {cvm}
    # The fifth check: `umbra ssh CVM -- id -u` answered the sandbox user's uid.
    assert result["check"]["ssh"]["ok"], result["check"]
    # Then the real agents in the sandbox: each got the stand-in's reply through the proxy, which
    # injected the key (the stand-in answers 401 to anything else).
    agents = result["check"]["agents"]
    assert set(agents) == {"claude -p", "codex exec"} and all(a["ok"] for a in agents.values()), (
        agents
    )
    assert result["dashboard_url"] == f"http://127.0.0.1:{up.base + 1}/ui/"
    assert result["ssh_identity"] == str(up.state / "keys" / "ssh" / "id_ed25519")
    assert not (Path(up.env["HOME"]) / ".ssh").exists(), "umbra up touched ~/.ssh"
    human = up.run("up")
    assert human.returncode == 0, human.stdout + human.stderr
    for step in ("umbra ssh", "umbra claude", "umbra logs", "umbra down", "/ui/"):
        assert step in human.stdout, (step, human.stdout)
    assert {r["owner"] for r in records} == {up_stack.SUBJECT}
    reasons = {r["reason"] for r in records if r["method"] == "POST"}
    assert "secret_detected" in reasons
    # The injected token never reaches the sandbox, a log, or the traffic records.
    token = (up.state / "keys" / "demo-token").read_bytes().strip()
    for path in [*up.state.glob("logs/*.log"), *up.state.glob("cvms/*/*.log")]:
        assert token not in path.read_bytes(), path
    plan = local_cvm.load_plan(up.state / "cvms", cvm)
    assert plan is not None
    # Every file the sandbox wrote is in its overlay's upper directory (the image is read-only).
    for path in (plan.dir / "upper").rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_size < 1 << 20:
            assert token not in path.read_bytes(), path


def test_every_credential_came_from_an_attested_enrollment(up: Up) -> None:
    """`up` wrote no credential: each CVM's launch data held a one-time token, spent by its
    (simulated) TD's enrollment and gone; the credentials it received are root-only."""
    stack = up.stack()
    scvm, dev = stack.state["security_cvm_id"], stack.state["dev_cvm_id"]
    security = up.state / "security-cvm"
    plan = local_cvm.load_plan(up.state / "cvms", dev)
    assert plan is not None
    for credential in (security / "console-credential", plan.dir / "credential"):
        assert credential.stat().st_mode & 0o777 == 0o600, credential
    assert not (security / "enrollment-token").exists(), "the Security CVM's token not spent"
    assert not (plan.launch_dir / "enrollment-token").exists(), "the Dev CVM's token not spent"
    assert "credential" not in json.loads((up.state / "local-cvms.json").read_text())
    identities = json.loads((security / "identities.json").read_text())
    assert identities == {"cvms": []}, "the tunnel credential came from the Console, not a file"
    with up_stack.api(stack, up_stack.token(up.env)) as client:
        page = client.get(f"/api/v1/teams/{up_stack.TEAM}/audit", params={"limit": 500}).json()
    entries = page["entries"] if isinstance(page, dict) else page
    enrolled = {
        (e["target"], e["details"].get("kind")) for e in entries if e["action"] == "cvm.enroll"
    }
    assert {(scvm, "security"), (dev, "dev")} <= enrolled


def test_internet_flag_runs_both_tools_through_the_security_cvm_and_reports_failures(
    up: Up,
) -> None:
    """`--internet`'s wiring, pointed at the stand-in origin (tests contact no real host): pip
    and git run inside the sandbox through the forwarder and the Security CVM; a check that
    fails (the origin is no package index; the git host is denied) is reported as failed with
    its reason, within its deadline, and the command exits 1 with the stack still up."""
    origin = f"{up_stack.DEMO_HOSTS[0]}:{up.base + 4}"
    targets = {
        "pypi_index": f"https://{origin}/simple",
        "pypi_files": f"https://{origin}",
        "git_url": f"https://{up_stack.DEMO_HOSTS[1]}:{up.base + 4}/git/git",
    }
    env = {**up.env, "UMBRA_UP_INTERNET_TARGETS": json.dumps(targets)}
    done = subprocess.run(
        [str(UMBRA), "up", "--check", "--internet", "--json", "--state-dir", str(up.state),
         "--port-base", str(up.base)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["ok"] is False and result["internet_ok"] is False
    assert len(result["check"]["records"]) >= 4, "the walkthrough itself still passed"
    checks = result["internet"]
    assert set(checks) == {"pip download", "git ls-remote"}
    for name, check in checks.items():
        assert check["ok"] is False and check["detail"].startswith("failed"), (name, check)
        assert check["seconds"] < 90 and check["exit_code"] is not None, (name, check)
    assert "403" in checks["git ls-remote"]["detail"], checks["git ls-remote"]
    # Both went through the sandbox's only exit: the Security CVM recorded them for this CVM.
    stack = up.stack()
    want_pip = _sandbox(up, "python3", "-m", "pip", "--version").returncode == 0

    def arrived(seen: set[tuple[str, str, str]]) -> bool:
        git = any(h == up_stack.DEMO_HOSTS[1] and "/git/git" in p for h, _d, p in seen)
        pip = any(h == up_stack.DEMO_HOSTS[0] and p.startswith("/simple") for h, _d, p in seen)
        return git and (pip or not want_pip)

    seen: set[tuple[str, str, str]] = set()
    deadline = time.monotonic() + 20  # the proxy ships its records about once a second
    with up_stack.api(stack, up_stack.token(up.env)) as client:
        while time.monotonic() < deadline:
            page = client.get(
                f"/api/v1/teams/{up_stack.TEAM}/traffic",
                params={"cvm_id": result["dev_cvm_id"], "limit": 200},
            ).json()
            records = page["records"] if isinstance(page, dict) else page
            seen = {(r["connect_host"], r["decision"], r.get("path") or "") for r in records}
            if arrived(seen):
                break
            time.sleep(0.25)
    assert arrived(seen), seen


def test_status_reports_every_component_and_the_runtime(up: Up) -> None:
    report = up.json("status")
    assert report["healthy"], report
    assert set(report["components"]) == {"issuer", "console", "origin", "llm", "proxy"}
    assert [c["runtime"] for c in report["dev_cvms"]] == ["runc"]


def _sandbox(up: Up, *command: str) -> subprocess.CompletedProcess[str]:
    stack = up.stack()
    plan = local_cvm.load_plan(up.state / "cvms", stack.state["dev_cvm_id"])
    assert plan is not None
    return subprocess.run(
        local_cvm.exec_argv(plan, list(command)), capture_output=True, text=True, timeout=60
    )


def test_sandbox_root_is_unprivileged_and_reaches_only_the_forwarder(up: Up) -> None:
    stack = up.stack()
    plan = local_cvm.load_plan(up.state / "cvms", stack.state["dev_cvm_id"])
    assert plan is not None
    uid_map = _sandbox(up, "cat", "/proc/self/uid_map").stdout.split()
    assert uid_map[:2] == ["0", str(plan.uid)] and plan.uid >= local_cvm.UID_BASE
    # Its root may change its own userland; the write lands in its overlay, never in the image.
    assert _sandbox(up, "sh", "-c", "touch /usr/umbra-x").returncode == 0
    assert (plan.dir / "upper" / "usr" / "umbra-x").exists()
    assert not any(
        (layer / "usr" / "umbra-x").exists() for layer in local_cvm.sandbox_spec(plan).image
    )
    # The forwarder's namespace never forwards, and binds its sandbox-side address even while
    # the sandbox's link is down: both set there explicitly, never inherited from the host.
    for key, want in (("ip_forward", "0"), ("ip_nonlocal_bind", "1")):
        shown = subprocess.run(
            ["ip", "netns", "exec", plan.forwarder_ns, "cat", f"/proc/sys/net/ipv4/{key}"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert shown.stdout.strip() == want, (key, shown)
    # The sandbox's network namespace is its own (runc's, in its user namespace: nested Docker
    # makes its bridge and NAT there), so its root may add a default route via the forwarder...
    added = _sandbox(up, "ip", "route", "add", "default", "via", plan.forwarder_addr)
    assert added.returncode == 0, added.stderr
    # ...and still reaches nothing but the forwarder's listeners.
    targets = [
        f"http://{plan.uplink_addr}:{stack.port('tunnel')}/",  # the forwarder's uplink address
        f"http://{plan.host_addr}:{stack.port('tunnel')}/",  # the host end of the uplink
        f"http://{plan.host_addr}:{local_cvm.INGRESS_PORT}/",  # the SSH ingress
        f"http://{local_cvm.SECURITY_CVM_ADDR}:{stack.port('tunnel')}/",  # the Security CVM
        f"http://{plan.forwarder_addr}:22/",  # another port on the forwarder
        f"http://127.0.0.1:{stack.port('console')}/healthz",  # the host's loopback
    ]
    try:
        for url in targets:
            done = _sandbox(up, "curl", "-sS", "--connect-timeout", "2", "--max-time", "4", url)
            assert done.returncode in (7, 28), (url, done.returncode, done.stdout)
    finally:
        # Later tests log in: with a route, a login shell's lookups would wait out timeouts.
        assert _sandbox(up, "ip", "route", "del", "default").returncode == 0
    # DNS never leaves: the forwarder answers every name with its own address (sandbox.md).
    dns = _sandbox(up, "sh", "-c", "getent hosts example.com || echo unresolved")
    assert dns.stdout.split()[:1] == [plan.forwarder_addr], dns.stdout
    assert _sandbox(up, "ip", "-6", "addr").stdout.strip() == ""


def _recorded_paths(up: Up, cvm: str, want: set[str]) -> set[str]:
    """Which of `want` the Security CVM's proxy recorded for `cvm` (it ships about once a second)."""
    stack = up.stack()
    seen: set[str] = set()
    deadline = time.monotonic() + 20
    with up_stack.api(stack, up_stack.token(up.env)) as client:
        while time.monotonic() < deadline and not want <= seen:
            page = client.get(
                f"/api/v1/teams/{up_stack.TEAM}/traffic", params={"cvm_id": cvm, "limit": 200}
            ).json()
            records = page["records"] if isinstance(page, dict) else page
            seen = {r.get("path") or "" for r in records if r["cvm_id"] == cvm}
            time.sleep(0.25)
    return want & seen


def test_nested_containers_go_through_the_forwarder_and_nowhere_else(up: Up) -> None:
    """Nested Docker has its own bridge and NAT in the sandbox's network namespace: a build's RUN
    step and a container reach the stand-in origin through the forwarder and the Security CVM
    (recorded for this CVM); from a nested container, even with the sandbox's default route via
    the forwarder, the uplink, the host end, the ingress, the Security CVM and UDP go nowhere."""
    stack = up.stack()
    cvm = stack.state["dev_cvm_id"]
    plan = local_cvm.load_plan(up.state / "cvms", cvm)
    assert plan is not None
    end = time.monotonic() + 60
    while _sandbox(up, "docker", "info").returncode != 0:
        assert time.monotonic() < end, _sandbox(up, "tail", "-20", "/var/log/dockerd.log").stdout
        time.sleep(0.5)
    origin = f"https://{up_stack.DEMO_HOSTS[0]}:{stack.port('origin')}"
    # The build's RUN step asks through the proxy for a denied host (busybox's wget speaks only
    # plain HTTP to a proxy): the answer it keeps is the Security CVM's refusal.
    build = _sandbox(
        up, "sh", "-c",
        "set -e; mkdir -p /tmp/nested && cd /tmp/nested && cp /bin/busybox . &&"
        " printf 'FROM scratch\\nCOPY busybox /bin/busybox\\n"
        'RUN ["/bin/busybox", "sh", "-c",'
        f' "/bin/busybox wget -T 20 -O /fetched http://{up_stack.DEMO_HOSTS[1]}/nested-build'
        ' 2>/answer; true"]\\n\''
        " > Dockerfile && docker build -q"
        f" --build-arg http_proxy={plan.proxy_url} -t umbra-nested . >/dev/null &&"
        " docker run --rm umbra-nested /bin/busybox cat /answer",
    )  # fmt: skip
    assert build.returncode == 0 and "403" in build.stdout, build.stdout + build.stderr

    def nested(script: str) -> subprocess.CompletedProcess[str]:
        # The sandbox's own tree as the nested container's userland (curl, the CA store).
        return _sandbox(
            up, "docker", "run", "--rm", "-v", "/:/host:ro", "umbra-nested",
            "/bin/busybox", "chroot", "/host", "/bin/sh", "-c", script,
        )  # fmt: skip

    ran = nested(
        f"curl -sS -m 20 -x {plan.proxy_url} -o /dev/null -w %{{http_code}} {origin}/nested-run"
    )
    assert ran.stdout == "200", ran
    assert _recorded_paths(up, cvm, {"/nested-build", "/nested-run"}) == {
        "/nested-build",
        "/nested-run",
    }
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((plan.host_addr, 0))
    udp.settimeout(2)
    port = udp.getsockname()[1]
    assert _sandbox(up, "ip", "route", "add", "default", "via", plan.forwarder_addr).returncode == 0
    try:
        for url in (
            f"http://{plan.uplink_addr}:{stack.port('tunnel')}/",
            f"http://{plan.host_addr}:{local_cvm.INGRESS_PORT}/",
            f"http://{local_cvm.SECURITY_CVM_ADDR}:{stack.port('tunnel')}/",
            f"http://{plan.forwarder_addr}:22/",
        ):
            done = nested(f"curl -sS --noproxy '*' --connect-timeout 2 --max-time 4 {url}")
            assert done.returncode != 0 and "curl: (" in done.stderr, (url, done)
        nested(
            'python3 -c "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM);'
            f" [s.sendto(b'x', ('{plan.host_addr}', p)) for p in ({port}, 53)]\""
        )
        with pytest.raises(TimeoutError):
            udp.recvfrom(16)
    finally:
        udp.close()
        assert _sandbox(up, "ip", "route", "del", "default").returncode == 0


def test_tools_without_proxy_variables_reach_the_proxy_through_the_forwarder(up: Up) -> None:
    """The local CVM's forwarder answers DNS with its own address and takes :443 by SNI to the
    Security CVM (sandbox.md "DNS and transparent mode"): a request with no proxy variable is
    decided and recorded by the proxy for this CVM."""
    stack = up.stack()
    plan = local_cvm.load_plan(up.state / "cvms", stack.state["dev_cvm_id"])
    assert plan is not None
    probe = (
        "import socket,struct;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.settimeout(5);"
        "q=struct.pack('!HHHHHH',7,256,1,0,0,0)+b'\\x04pypi\\x03org\\x00'+struct.pack('!HH',1,1);"
        f"s.sendto(q,('{plan.forwarder_addr}',53));r=s.recv(512);print(socket.inet_ntoa(r[-4:]))"
    )
    answer = _sandbox(up, "python3", "-c", probe)
    assert answer.stdout.strip() == plan.forwarder_addr, answer
    host = up_stack.DEMO_HOSTS[1]
    done = _sandbox(
        # the Security CVM's CA is in the image's system store (sandbox/image.py)
        up, "curl", "-sS", "--max-time", "20", "--resolve",
        f"{host}:443:{plan.forwarder_addr}", "-o", "/dev/null", "-w", "%{http_code}",
        f"https://{host}/transparent-probe",
    )  # fmt: skip
    assert done.stdout == "403", done  # the demo profile allows only the origin's own port
    deadline = time.monotonic() + 20
    with up_stack.api(stack, up_stack.token(up.env)) as client:
        while True:
            page = client.get(
                f"/api/v1/teams/{up_stack.TEAM}/traffic",
                params={"cvm_id": stack.state["dev_cvm_id"], "limit": 200},
            ).json()
            records = page["records"] if isinstance(page, dict) else page
            hits = [r for r in records if r.get("path") == "/transparent-probe"]
            if hits or time.monotonic() > deadline:
                break
            time.sleep(0.25)
    assert hits and hits[0]["decision"] == "deny" and hits[0]["connect_host"] == host, records


def test_umbra_ssh_runs_inside_the_sandbox_as_its_user(up: Up) -> None:
    plan = local_cvm.load_plan(up.state / "cvms", up.stack().state["dev_cvm_id"])
    assert plan is not None
    token = secrets.token_hex(8)
    (plan.rootfs / "tmp" / "uwi-marker").write_text(token)  # only the sandbox's tree has it
    done = up.client("ssh", "--no-reuse", "--", "id -u; hostname; pwd; cat /tmp/uwi-marker")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(local_cvm.SANDBOX_USER_UID), "umbra-dev", "/home/dev", token]
    assert not Path("/tmp/uwi-marker").exists()
    # Root in the sandbox has no way to the gateway's files (host key, login keys).
    gateway = up.client("ssh", "--no-reuse", "--", f"ls {plan.dir / 'gateway'} 2>&1")
    assert "ssh_host_ed25519_key" not in gateway.stdout


def test_sessions_have_the_sandbox_environment_and_find_the_agents(up: Up) -> None:
    """`umbra ssh -- cmd` (and so `umbra claude`, which runs `dtach -A … claude` the same way)
    gets the sandbox's login environment: the agents, the proxy, the CA variables, sudo, and a
    binary the user installed under ~/.local/bin."""
    plan = local_cvm.load_plan(up.state / "cvms", up.stack().state["dev_cvm_id"])
    assert plan is not None
    install = "mkdir -p ~/.local/bin && printf '#!/bin/sh\\necho mine\\n' > ~/.local/bin/mytool"
    assert (
        up.client(
            "ssh", "--no-reuse", "--", install + " && chmod +x ~/.local/bin/mytool"
        ).returncode
        == 0
    )
    done = up.client(
        "ssh", "--no-reuse", "--",
        "mytool; command -v claude codex; echo $HTTPS_PROXY $NODE_EXTRA_CA_CERTS; sudo -n id -u",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines[0] == "mine"
    assert lines[1:3] == ["/usr/local/bin/claude", "/usr/local/bin/codex"]
    assert lines[3:] == [plan.proxy_url, "/etc/ssl/certs/ca-certificates.crt", "0"]


def _session_env(up: Up, name: str) -> str:
    done = up.client("ssh", "--no-reuse", "--", f"echo ${{{name}:-unset}}")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _wait_session_env(up: Up, name: str, want: str, within: float = 30) -> float:
    start = time.monotonic()
    while (got := _session_env(up, name)) != want:
        assert time.monotonic() - start < within, f"{name} is {got!r}, not {want!r}"
        time.sleep(0.5)
    return time.monotonic() - start


def test_attached_profiles_sandbox_env_reaches_sessions_within_seconds(up: Up) -> None:
    """An attach puts the profile's `sandbox_env` into the next session (ssh and
    run_in_sandbox's login shell alike, and `sudo -i`/`su -` inside one) within seconds; a
    detach takes it out again. The agent keys' placeholders come from the stand-in profiles
    attached by default, not the image."""
    cvm = up.stack().state["dev_cvm_id"]
    plan = local_cvm.load_plan(up.state / "cvms", cvm)
    assert plan is not None
    _wait_session_env(up, "ANTHROPIC_API_KEY", "umbra-placeholder:team/anthropic-api-key")
    assert _session_env(up, "CLAUDE_CODE_OAUTH_TOKEN") == "unset"
    attached = up.client("profile", "attach", cvm, "claude-subscription")
    assert attached.returncode == 0, attached.stderr
    placeholder = "umbra-placeholder:personal/claude-oauth-token"
    seconds = _wait_session_env(up, "CLAUDE_CODE_OAUTH_TOKEN", placeholder)
    print(f"sandbox_env reached a session {seconds:.1f} s after the attach")
    done = local_cvm.run_in_sandbox(plan, ["printenv", "CLAUDE_CODE_OAUTH_TOKEN"])
    assert done.stdout.strip() == placeholder
    # Login shells started inside a session after the attach read the file of now too.
    assert login_shells_see(plan, "CLAUDE_CODE_OAUTH_TOKEN") == dict.fromkeys(
        LOGIN_SHELLS, placeholder
    )
    detached = up.client("profile", "detach", cvm, "claude-subscription")
    assert detached.returncode == 0, detached.stderr
    _wait_session_env(up, "CLAUDE_CODE_OAUTH_TOKEN", "unset")
    # ...and a detach takes it out of them: nothing (PAM's /etc/environment) keeps a copy.
    assert login_shells_see(plan, "CLAUDE_CODE_OAUTH_TOKEN") == dict.fromkeys(LOGIN_SHELLS, "unset")
    assert pam_env_assignments(plan) == "0"
    # The CVM's own values stay whatever the profiles say.
    assert _session_env(up, "HTTPS_PROXY") == plan.proxy_url


def test_umbra_ssh_refuses_a_quote_that_is_not_the_recorded_release(up: Up) -> None:
    stack = up.stack()
    cvm = stack.state["dev_cvm_id"]
    db = sqlite3.connect(up.state / "console.db", timeout=30)
    try:
        (raw,) = db.execute("SELECT provider_state FROM cvm WHERE id = ?", (cvm,)).fetchone()
        state = json.loads(raw)
        assert state["ssh_ingress"] == {"host": f"10.232.{_index(up)}.1", "port": 2222}
        wrong = {**state["release_manifest"], **simulated_boot_values("another-image")}
        with db:
            db.execute(
                "UPDATE cvm SET provider_state = ? WHERE id = ?",
                (json.dumps({**state, "release_manifest": wrong}), cvm),
            )
        refused = up.client("ssh", "--no-reuse", "--", "echo", "reached")
        assert refused.returncode == 255 and "reached" not in refused.stdout
        assert f"refused {cvm}: release:" in refused.stderr, refused.stderr
    finally:
        with db:
            db.execute("UPDATE cvm SET provider_state = ? WHERE id = ?", (raw, cvm))
        db.close()
    # A client trusting another simulated TEE root refuses this one's quotes too.
    other = simulated_pki(up.state.parent / "other-pki")
    env = {**up.env, "UMBRA_SIMULATED_PKI": str(other)}
    refused = up.client("ssh", "--no-reuse", "--", "echo", "reached", env=env)
    assert refused.returncode == 255 and "reached" not in refused.stdout, refused.stderr
    assert f"refused {cvm}" in refused.stderr
    assert up.client("ssh", "--no-reuse", "--", "true").returncode == 0


def _index(up: Up) -> int:
    plan = local_cvm.load_plan(up.state / "cvms", up.stack().state["dev_cvm_id"])
    assert plan is not None
    return plan.index


def _read_until(fd: int, pattern: bytes, timeout: float = 30) -> re.Match[bytes]:
    out = b""
    deadline = time.monotonic() + timeout
    while (found := re.search(pattern, out)) is None:
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {pattern!r}; got {out[-400:]!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                chunk = b""
            assert chunk, f"pty closed before {pattern!r}; got {out[-400:]!r}"
            out += chunk
    return found


def _shell_pid(up: Up) -> int:
    """Attach to the `t1` shell session, ask for its pid, then drop the connection (kill -9)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [str(UMBRA), "shell", "--name", "t1", "--no-reuse"],
        stdin=slave, stdout=slave, stderr=slave, env=up.env, start_new_session=True,
    )  # fmt: skip
    os.close(slave)
    try:
        time.sleep(0.5)
        os.write(master, b"echo PID=$(( $$ + 0 ))=END\r")
        return int(_read_until(master, rb"PID=(\d+)=END").group(1))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the laptop's connection dies
        proc.wait(timeout=10)
        os.close(master)


def test_a_dropped_session_reattaches_the_same_process(up: Up) -> None:
    first = _shell_pid(up)
    assert _shell_pid(up) == first
    listed = up.client("sessions", "--no-reuse", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {"agent": "shell", "name": "t1"} in json.loads(listed.stdout)["sessions"]


def test_umbra_claude_starts_the_real_agent_under_dtach(up: Up) -> None:
    """The issue's symptom was `dtach: could not execute claude`. Now the real Claude Code runs
    in the sandbox under dtach with the sandbox's proxy: with no Anthropic profile attached here
    (the stand-in origin is the agents part of #21) it says it cannot reach api.anthropic.com
    through the configured https_proxy, which only a running agent can say."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [str(UMBRA), "claude", "--name", "t3", "--no-reuse"],
        stdin=slave, stdout=slave, stderr=slave, env=up.env, start_new_session=True,
    )  # fmt: skip
    os.close(slave)
    try:
        _read_until(master, rb"api\.anthropic\.com", timeout=90)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        os.close(master)


def test_the_next_up_binds_a_key_the_developer_made_since(up: Up) -> None:
    ssh_dir = Path(up.env["HOME"]) / ".ssh"
    ssh_dir.mkdir(mode=0o700)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh_dir / "id_ed25519")],
        check=True,
    )
    result = up.json("up")
    assert result["ok"] and result["ssh_identity"] == str(ssh_dir / "id_ed25519"), result
    plan = local_cvm.load_plan(up.state / "cvms", result["dev_cvm_id"])
    assert plan is not None
    public = (ssh_dir / "id_ed25519.pub").read_text().split()[:2]
    assert (plan.launch_dir / "authorized_keys").read_text().split()[:2] == public
    done = up.client("ssh", "--no-reuse", "--", "true")
    assert done.returncode == 0, done.stderr


def test_second_up_while_one_runs_is_refused(up: Up) -> None:
    with (up.state / "up.lock").open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        done = up.run("up")
    assert done.returncode == 1
    assert "error: another `umbra up`" in done.stderr and "fix:" in done.stderr


def test_kill_9_is_reported_restarted_and_no_record_is_lost(up: Up) -> None:
    stack = up.stack()
    cvm = stack.state["dev_cvm_id"]
    plan = local_cvm.load_plan(up.state / "cvms", cvm)
    assert plan is not None
    console_pid, forwarder_pid = stack.pid("console"), local_cvm.running_pid(plan, "forwarder")
    ingress_pid = local_cvm.running_pid(plan, "ingress")
    assert console_pid and forwarder_pid and ingress_pid
    os.kill(ingress_pid, signal.SIGKILL)
    refused = up.client("ssh", "--no-reuse", "--", "true")
    assert refused.returncode == 255 and f"refused {cvm}: ingress:" in refused.stderr, refused
    os.kill(console_pid, signal.SIGKILL)
    # With the Console down, the proxy still decides (cached bundle) and spools the record.
    started = time.time()
    stamp = f"/v1/while-console-down-{int(started)}"
    done = _sandbox(
        up, "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "20",
        "--cacert", "/etc/ssl/certs/ca-certificates.crt", "--proxy", plan.proxy_url,
        f"https://api.demo.test:{stack.port('origin')}{stamp}",
    )  # fmt: skip
    assert done.stdout == "200", f"{done}\n{up.logs()}"
    os.killpg(forwarder_pid, signal.SIGKILL)
    proxy_pid = stack.pid("proxy")
    assert proxy_pid
    # The spool promises a record on disk within a flush interval of its decision, not before
    # the response: wait until it is there (a fixed sleep lost it on a loaded machine), then kill.
    spool = up.state / "security-cvm" / "spool"
    end = time.monotonic() + 15
    while not any(stamp in seg.read_text(errors="replace") for seg in spool.glob("*.jsonl")):
        assert time.monotonic() < end, f"the record never reached the spool\n{up.logs()}"
        time.sleep(0.05)
    os.killpg(proxy_pid, signal.SIGKILL)
    time.sleep(0.3)
    report = up.json("status")
    assert not report["healthy"]
    assert not report["components"]["console"]["running"]
    assert not report["components"]["proxy"]["running"]
    assert not report["dev_cvms"][0]["healthy"]
    assert report["dev_cvms"][0]["ingress_pid"] is None
    assert up.run("status").returncode == 1

    result = up.json("up")
    assert result["ok"], result
    assert up.json("status")["healthy"]
    assert local_cvm.running_pid(plan, "ingress") not in (None, ingress_pid)
    assert up.client("ssh", "--no-reuse", "--", "true").returncode == 0
    stack = up.stack()
    with up_stack.api(stack, up_stack.token(up.env)) as client:
        end = time.monotonic() + 60
        while True:
            page = client.get(
                f"/api/v1/teams/{up_stack.TEAM}/traffic", params={"cvm_id": cvm, "limit": 50}
            ).json()
            if any(r.get("path") == stamp for r in page["records"]):
                break
            assert time.monotonic() < end, "the record made while the Console was down was lost"
            time.sleep(0.5)


def test_zz_down_leaves_nothing(up: Up) -> None:
    started = time.monotonic()
    done = up.json("down")
    assert done["ok"]
    assert time.monotonic() - started < 30
    assert _leftovers(up) == []
    assert up.run("status").returncode == 1


def test_port_in_use_is_refused_and_nothing_is_started(tmp_path: Path) -> None:
    _require_root()
    base = _free_base()
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "NO_COLOR": "1"}
    other = Up(tmp_path / "state", base, f"uuq{os.getpid() % 100000}", env)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", base + up_stack.PORTS["console"]))
        squatter.listen()
        done = other.run("up")
    assert done.returncode == 1
    assert f"port {base + 1} (console) is in use" in done.stderr.replace("\n", " ")
    assert "--port-base" in done.stderr
    assert _leftovers(other) == []


def test_not_root_and_missing_packages_get_one_message_and_a_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = up_stack.Stack(tmp_path, _free_base())
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(up_stack.UpError) as not_root:
        up_stack.preflight(stack)
    assert "needs root" in str(not_root.value) and "sudo" in not_root.value.fix
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "nft" else real_which(name))
    with pytest.raises(up_stack.UpError) as missing:
        up_stack.preflight(stack)
    assert "nftables" in str(missing.value) and "system-deps" in missing.value.fix
