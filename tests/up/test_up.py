"""`umbra up` end to end, as a user runs it: real processes, real namespaces, a real Console,
proxy, forwarder and sandbox; then the faults, and `umbra down` leaving nothing behind.

Everything is named with a prefix unique to this test run (namespaces, veths) and lives in a temp
state directory with its own ports, so it runs beside other users of the machine.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from umbra.cli import up_stack
from umbra.sandbox import local_cvm

ROOT = Path(__file__).resolve().parents[2]
UMBRA = ROOT / ".venv" / "bin" / "umbra"


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("umbra up needs root (namespaces); CI runs as root")
    missing = [t for t in up_stack.REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"missing {missing}: scripts/system-deps installs them")


def _free_base() -> int:
    """Five consecutive free loopback ports."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = int(sock.getsockname()[1])
        if base > 60000:
            continue
        ok = True
        for offset in range(5):
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
        return subprocess.run(
            [str(UMBRA), *args, "--state-dir", str(self.state), "--port-base", str(self.base)],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=ROOT,
            timeout=timeout,
        )

    def json(self, *args: str) -> dict[str, Any]:
        done = self.run(*args, "--json")
        assert done.stdout, done.stderr
        result: dict[str, Any] = json.loads(done.stdout)
        return result

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
    return found


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    _require_root()
    tmp = tmp_path_factory.mktemp("up")
    prefix = f"uup{os.getpid() % 100000}"
    env = {
        **os.environ,
        "XDG_CONFIG_HOME": str(tmp / "config"),
        "UMBRA_UP_NAME_PREFIX": prefix,
        "NO_COLOR": "1",
        "COLUMNS": "200",
    }
    env.pop("UMBRA_STATE_DIR", None)
    handle = Up(tmp / "state", _free_base(), prefix, env)
    try:
        yield handle
    finally:
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
    assert {r["owner"] for r in records} == {up_stack.SUBJECT}
    reasons = {r["reason"] for r in records if r["method"] == "POST"}
    assert "secret_detected" in reasons
    # The injected token never reaches the sandbox, a log, or the traffic records.
    token = (up.state / "keys" / "demo-token").read_bytes().strip()
    for path in [*up.state.glob("logs/*.log"), *up.state.glob("cvms/*/*.log")]:
        assert token not in path.read_bytes(), path
    plan = local_cvm.load_plan(up.state / "cvms", cvm)
    assert plan is not None
    for path in plan.rootfs.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_size < 1 << 20:
            assert token not in path.read_bytes(), path


def test_status_reports_every_component_and_the_runtime(up: Up) -> None:
    report = up.json("status")
    assert report["healthy"], report
    assert set(report["components"]) == {"issuer", "console", "origin", "proxy"}
    assert [c["runtime"] for c in report["dev_cvms"]] == ["namespaces"]


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
    assert _sandbox(up, "sh", "-c", "touch /usr/umbra-x").returncode != 0  # read-only userland
    for ns in (plan.sandbox_ns, plan.forwarder_ns):
        forward = subprocess.run(
            ["ip", "netns", "exec", ns, "cat", "/proc/sys/net/ipv4/ip_forward"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert forward.stdout.strip() == "0", ns
    # Sandbox root has no CAP_NET_ADMIN over its network namespace (owned by the host's user
    # namespace): it cannot even change its routes...
    refused = _sandbox(up, "ip", "route", "add", "default", "via", plan.forwarder_addr)
    assert refused.returncode != 0 and "not permitted" in refused.stderr
    # ...and had it done so (as the cloud sandbox's root may), it would still reach nothing else.
    subprocess.run(
        ["ip", "-n", plan.sandbox_ns, "route", "add", "default", "via", plan.forwarder_addr],
        check=True,
    )
    targets = [
        f"http://{plan.uplink_addr}:{stack.port('tunnel')}/",  # the forwarder's uplink address
        f"http://{plan.host_addr}:{stack.port('tunnel')}/",  # the host end of the uplink
        f"http://{local_cvm.SECURITY_CVM_ADDR}:{stack.port('tunnel')}/",  # the Security CVM
        f"http://{plan.forwarder_addr}:22/",  # another port on the forwarder
        f"http://127.0.0.1:{stack.port('console')}/healthz",  # the host's loopback
    ]
    for url in targets:
        done = _sandbox(up, "curl", "-sS", "--connect-timeout", "2", "--max-time", "4", url)
        assert done.returncode in (7, 28), (url, done.returncode, done.stdout)
    dns = _sandbox(up, "sh", "-c", "getent hosts example.com || echo unresolved")
    assert "unresolved" in dns.stdout
    assert _sandbox(up, "ip", "-6", "addr").stdout.strip() == ""


def test_second_up_while_one_runs_is_refused(up: Up) -> None:
    with (up.state / "up.lock").open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        done = up.run("up")
    assert done.returncode == 1
    assert "another `umbra up`" in done.stdout and "fix:" in done.stdout


def test_kill_9_is_reported_restarted_and_no_record_is_lost(up: Up) -> None:
    stack = up.stack()
    cvm = stack.state["dev_cvm_id"]
    plan = local_cvm.load_plan(up.state / "cvms", cvm)
    assert plan is not None
    console_pid, forwarder_pid = stack.pid("console"), local_cvm.running_pid(plan, "forwarder")
    assert console_pid and forwarder_pid
    os.kill(console_pid, signal.SIGKILL)
    # With the Console down, the proxy still decides (cached bundle) and spools the record.
    started = time.time()
    stamp = f"/v1/while-console-down-{int(started)}"
    done = _sandbox(
        up, "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "20",
        "--cacert", "/umbra/proxy-ca.pem", "--proxy", f"http://{plan.forwarder_addr}:3128",
        f"https://api.demo.test:{stack.port('origin')}{stamp}",
    )  # fmt: skip
    assert done.stdout == "200", done
    os.killpg(forwarder_pid, signal.SIGKILL)
    proxy_pid = stack.pid("proxy")
    assert proxy_pid
    time.sleep(0.5)  # the record reaches the spool on disk
    os.killpg(proxy_pid, signal.SIGKILL)
    time.sleep(0.3)
    report = up.json("status")
    assert not report["healthy"]
    assert not report["components"]["console"]["running"]
    assert not report["components"]["proxy"]["running"]
    assert not report["dev_cvms"][0]["healthy"]
    assert up.run("status").returncode == 1

    result = up.json("up")
    assert result["ok"], result
    assert up.json("status")["healthy"]
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
    assert f"port {base + 1} (console) is in use" in done.stdout.replace("\n", " ")
    assert "--port-base" in done.stdout
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
