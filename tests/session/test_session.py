"""The developer's session path end to end: real OpenSSH client and gateway sshd, a sandbox in
its own user/network/pid namespaces, aTLS to a simulated TD, and a real Console."""

from __future__ import annotations

import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.session import harness
from tests.session.conftest import Developer
from umbra.cli.ssh_config import ssh_argv


@pytest.fixture(scope="module")
def box() -> Iterator[harness.Sandbox]:
    harness.require_tools()
    with harness.sandbox() as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def cvm(
    developer: Developer,
    box: harness.Sandbox,
    pki_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, harness.IngressProc]]:
    cvm_id = developer.create_cvm(harness.unique_name())
    work = tmp_path_factory.mktemp("cvm")
    with harness.ingress(box, work, cvm_id, [developer.pub], pki_dir) as ing:
        developer.record(cvm_id, port=ing.port, release=harness.release_manifest())
        yield cvm_id, ing


def _ssh(developer: Developer, cvm_id: str, *args: str, tool: str = "ssh") -> list[str]:
    os.environ.update({k: v for k, v in developer.env.items() if k.startswith(("UMBRA_", "XDG_"))})
    argv = ssh_argv(cvm_id, reuse=False)
    alias = argv.pop()
    return [tool, *argv[1:], *args, alias] if tool != "ssh" else [*argv, *args, alias]


def test_umbra_ssh_runs_a_command_in_the_sandbox(
    developer: Developer, cvm: tuple[str, harness.IngressProc], box: harness.Sandbox
) -> None:
    cvm_id, ing = cvm
    done = developer.umbra(
        "ssh", cvm_id, "--no-reuse", "--", "id -u; pwd; echo ${SSH_AUTH_SOCK:-no-agent}"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1000", str(box.home), "no-agent"]
    default = developer.umbra("ssh", "--no-reuse", "--", "echo default-cvm")  # the only running one
    assert default.stdout.strip() == "default-cvm", default.stderr
    known = (developer.home / ".config/umbra/ssh/known_hosts").read_text()
    host_pub = (ing.state_dir / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    assert known.startswith(f"umbra-{cvm_id} {' '.join(host_pub)} umbra-boot=")  # one pin


def test_connection_reuse_skips_the_handshake(
    developer: Developer, cvm: tuple[str, harness.IngressProc]
) -> None:
    cvm_id, _ = cvm
    try:
        first = developer.umbra("ssh", cvm_id, "--", "echo one")
        assert first.returncode == 0 and first.stdout.strip() == "one", first.stderr
        control = list(Path(developer.env["TMPDIR"]).glob("umbra-ssh-*/*"))
        assert control, "no ControlMaster socket"
        second = developer.umbra("ssh", cvm_id, "--", "echo two")
        assert second.stdout.strip() == "two", second.stderr
    finally:
        os.environ.update(developer.env)
        subprocess.run(
            [*ssh_argv(cvm_id)[:-1], "-O", "exit", f"umbra-{cvm_id}"],
            env=developer.env,
            capture_output=True,
        )


def _read_until(fd: int, needle: bytes, timeout: float = 20) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while needle not in out:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out waiting for {needle!r}; got {out[-400:]!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                raise AssertionError(f"pty closed before {needle!r}; got {out[-400:]!r}")
            out += chunk
    return out


def _attach(
    developer: Developer, cvm_id: str, name: str = "t1"
) -> tuple[subprocess.Popen[bytes], int]:
    master, slave = pty.openpty()
    exe = str(Path(sys.executable).parent / "umbra")
    proc = subprocess.Popen(
        [exe, "claude", cvm_id, "--name", name, "--no-reuse"],
        stdin=slave, stdout=slave, stderr=slave, env=developer.env, start_new_session=True,
    )  # fmt: skip
    os.close(slave)
    return proc, master


def test_agent_survives_a_dropped_connection_and_reattaches(
    developer: Developer, cvm: tuple[str, harness.IngressProc], box: harness.Sandbox
) -> None:
    cvm_id, _ = cvm
    fake = box.bin / "claude"  # the agent: prints its pid and flags, then echoes lines
    fake.write_text(
        '#!/bin/sh\necho "agent pid $$ flags $*"\n'
        'while read -r line; do echo "pid $$ got $line"; done\n'
    )
    fake.chmod(0o755)
    proc, master = _attach(developer, cvm_id)
    try:
        text = _read_until(master, b"flags --dangerously-skip-permissions").decode()
        pid = text.split("agent pid ")[1].split()[0]
        os.killpg(proc.pid, signal.SIGKILL)  # the laptop's connection dies
        proc.wait(timeout=10)
    finally:
        os.close(master)
    proc, master = _attach(developer, cvm_id)
    try:
        time.sleep(1.0)
        os.write(master, b"hello\r")
        _read_until(master, f"pid {pid} got hello".encode())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        os.close(master)
    listed = developer.umbra("sessions", cvm_id, "--no-reuse", "--json")
    assert listed.returncode == 0, listed.stderr
    assert '"agent": "claude"' in listed.stdout and '"name": "t1"' in listed.stdout


def test_remote_ssh_needs_exec_with_stdin_sftp_and_local_forwarding(
    developer: Developer, cvm: tuple[str, harness.IngressProc], box: harness.Sandbox, tmp_path: Path
) -> None:
    cvm_id, _ = cvm
    # 1. what VS Code's Remote-SSH does first: a shell reading a script from stdin
    script = "echo start\nid -u\necho $HOME\n"
    done = subprocess.run(
        [*_ssh(developer, cvm_id), "sh"], input=script, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["start", "1000", str(box.home)]
    # 2. sftp put and get, landing in the sandbox as the sandbox user
    local = tmp_path / "up.txt"
    local.write_text("payload\n")
    batch = tmp_path / "batch"
    batch.write_text(f"put {local} {box.home}/up.txt\nget {box.home}/up.txt {tmp_path}/down.txt\n")
    done = subprocess.run(
        _ssh(developer, cvm_id, "-b", str(batch), tool="sftp"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "down.txt").read_text() == "payload\n"
    assert (box.home / "up.txt").stat().st_uid == box.uid_base + harness.SANDBOX_UID
    # 3. -L to a port served inside the sandbox (loopback of its network namespace)
    inner = harness.free_port()
    server = box.spawn_in_net([
        sys.executable, "-c",
        "import socket;s=socket.create_server(('127.0.0.1',"
        f"{inner}));c,_=s.accept();c.sendall(b'inside');c.close()",
    ])  # fmt: skip
    local_port = harness.free_port()
    fwd = subprocess.Popen(
        _ssh(
            developer,
            cvm_id,
            "-N",
            "-o",
            "ExitOnForwardFailure=yes",
            "-L",
            f"127.0.0.1:{local_port}:127.0.0.1:{inner}",
        )
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", local_port), timeout=5) as c:
                    data = c.recv(100)
                if data:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "forward never answered"
            time.sleep(0.2)
        assert data == b"inside"
    finally:
        fwd.kill()
        fwd.wait()
        server.kill()
        server.wait()


def test_root_in_the_sandbox_cannot_add_a_login_key_or_read_the_gateway(
    developer: Developer, cvm: tuple[str, harness.IngressProc], box: harness.Sandbox, tmp_path: Path
) -> None:
    cvm_id, ing = cvm
    attacker, attacker_pub = harness.keypair(tmp_path, "attacker")
    state = ing.state_dir
    for attempt in (
        f"cat {state}/sshd_config",
        f"cat {state}/ssh_host_ed25519_key",
        f"echo '{attacker_pub}' >> {state}/authorized_keys",
        f"echo '{attacker_pub}' >> {ing.launch_dir}/authorized_keys",
        f"ls {state}",
    ):
        done = box.run(attempt, root=True)
        assert done.returncode != 0, f"root in the sandbox could: {attempt}"
    # keys in home directories count for nothing: sshd reads only the gateway's copy
    planted = box.run(
        f"mkdir -p {box.home}/.ssh && echo '{attacker_pub}' > {box.home}/.ssh/authorized_keys",
        root=True,
    )
    assert planted.returncode == 0, planted.stderr
    argv = _ssh(developer, cvm_id, "-o", "BatchMode=yes")
    argv = [a.replace(str(developer.key), str(attacker)) for a in argv]
    done = subprocess.run([*argv, "true"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 255 and "Permission denied" in done.stderr


@pytest.mark.usefixtures("cvm")
def test_config_ssh_round_trip(developer: Developer) -> None:
    config = developer.home / ".ssh" / "config"
    config.write_text("Host elsewhere\n    HostName example.com\n")
    dry = developer.umbra("config-ssh", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "+# >>> umbra config-ssh" in dry.stdout
    assert config.read_text() == "Host elsewhere\n    HostName example.com\n"
    assert developer.umbra("config-ssh").returncode == 0
    text = config.read_text()
    assert text.startswith("Host elsewhere\n    HostName example.com\n")
    name = next(line.split()[1] for line in text.splitlines() if line.startswith("Host umbra-"))
    done = subprocess.run(
        ["ssh", "-F", str(config), "-o", "ControlMaster=no", "-o", "ControlPath=none", name, "echo via-config"],
        capture_output=True, text=True, env=developer.env, timeout=60,
    )  # fmt: skip
    assert done.stdout.strip() == "via-config", done.stderr
    ide = developer.umbra("code", "--dry-run", "/home/dev/project")
    assert ide.returncode == 0, ide.stderr
    assert f'"ssh-remote+{name}"' in ide.stdout and '"--remote"' in ide.stdout
    again = developer.umbra("config-ssh", "--dry-run")
    assert again.stdout == ""  # idempotent: nothing to change
    assert config.read_text() == text


def test_sessions_kill_ends_the_agent_and_the_name_can_start_again(
    developer: Developer, cvm: tuple[str, harness.IngressProc], box: harness.Sandbox
) -> None:
    cvm_id, _ = cvm
    fake = box.bin / "claude"
    fake.write_text(
        '#!/bin/sh\necho "agent pid $$ flags $*"\n'
        'while read -r line; do echo "pid $$ got $line"; done\n'
    )
    fake.chmod(0o755)

    def start() -> str:
        proc, master = _attach(developer, cvm_id, "k1")
        try:
            text = _read_until(master, b"flags --dangerously-skip-permissions").decode()
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # detach: the agent keeps running
            proc.wait(timeout=10)
            os.close(master)
        return text.split("agent pid ")[1].split()[0]

    first = start()
    alive = developer.umbra("ssh", cvm_id, "--no-reuse", "--", f"kill -0 {first} && echo alive")
    assert alive.stdout.strip() == "alive", alive.stderr
    missing = developer.umbra("sessions", "kill", "nope", "--cvm", cvm_id, "--no-reuse")
    assert missing.returncode == 1
    assert "no session 'nope'" in missing.stderr and "umbra sessions" in missing.stderr
    killed = developer.umbra("sessions", "kill", "k1", "--cvm", cvm_id, "--no-reuse", "--json")
    assert killed.returncode == 0, killed.stderr
    assert '"agent": "claude"' in killed.stdout and '"state": "killed"' in killed.stdout
    # Gone, or a zombie: the test sandbox's pid 1 does not reap (a real CVM's init does).
    state = f"s=$(cut -d' ' -f3 /proc/{first}/stat 2>/dev/null); [ \"${{s:-Z}}\" = Z ] && echo gone"
    gone = developer.umbra("ssh", cvm_id, "--no-reuse", "--", state)
    assert gone.stdout.strip() == "gone", (killed.stdout, gone.stdout, gone.stderr)
    listed = developer.umbra("sessions", cvm_id, "--no-reuse", "--json")  # `sessions CVM` lists
    assert listed.returncode == 0, listed.stderr
    assert '"name": "k1"' not in listed.stdout
    # Reattach by name still works: the same name starts a fresh agent.
    assert start() != first
    developer.umbra("sessions", "kill", "k1", "--agent", "claude", "--cvm", cvm_id, "--no-reuse")
