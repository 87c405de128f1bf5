"""A cloud Dev CVM as `umbra ssh` sees it: the launch agent boots a simulated TD (launch data
with a host firewall, served by a metadata stand-in), and the client's own verification code
(session_policy + CapturingVerifier + check_host_key: what `umbra ssh-proxy`'s aTLS accept
callback runs) accepts its quote and learns the host key the agent generated; a firewall other
than the launch-bound one, an unrecorded one, or a tampered log is refused on the named check."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from umbra.attest.eventlog import Event, make_runtime_event
from umbra.attest.session_info import SessionInfo
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.cli import ssh_attest
from umbra.cli.ssh_attest import Check, Refused
from umbra.components.launch_data import LaunchData
from umbra.contracts.session import SessionState, SshIngress
from umbra.images import launch_ingress, os_image
from umbra.images.launch_agent import Agent, GcpMetadata, LaunchError, Refusal
from umbra.images.launch_ingress import AttestedIngress, IngressStartError, PidFileSandbox
from umbra.images.measure import HOST_FIREWALL_EVENT, measure
from umbra.sandbox.ingress import Ingress
from umbra.sandbox.ingress_config import IngressConfig, load_ingress_config
from umbra.sandbox.sandbox_locator import SandboxLocateError

from ..sandbox.fixtures import dev_definition
from ..session import harness
from ..session.harness import free_port
from .simulated_rtmr import SimulatedRtmr
from .test_launch_agent import ALICE, StandIn, standin

__all__ = ["standin"]  # the metadata stand-in fixture, shared with test_launch_agent
CVM = "dev-alice-1"
SSH_HOST_KEY = "umbra.ssh-host-key"


@dataclass
class Loaded:
    """The host firewall seam (nft itself is driven for real in test_launch_host)."""

    rulesets: list[str] = field(default_factory=list)

    def load(self, ruleset: str) -> None:
        self.rulesets.append(ruleset)


@dataclass
class Started:
    """The compose starter seam; records the order of what the agent started."""

    order: list[str] = field(default_factory=list)

    def start(self, compose: Path | None = None) -> None:
        self.order.append("compose" if compose is not None else "ingress")


@dataclass
class FixedSandbox:
    """Stands in for `docker inspect`: the sandbox container's PID (or no container)."""

    pid_: int | None

    def pid(self) -> int:
        if self.pid_ is None:
            raise IngressStartError("want exactly one running umbra-dev/sandbox container, got 0")
        return self.pid_


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimulatedPki:
    """The developer's machine: its own config dir and its own trust in this simulated PKI."""
    pki = SimulatedPki.generate()
    pki.save(tmp_path / "pki")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv(ssh_attest.SIMULATED_PKI_ENV, str(tmp_path / "pki"))
    return pki


def _boot(
    standin: StandIn,
    pki: SimulatedPki,
    tmp_path: Path,
    key: str = ALICE,
    ingress: AttestedIngress | None = None,
    lines: list[str] | None = None,
    starter: Started | None = None,
) -> tuple[SimulatedTdx, LaunchData]:
    m = measure(dev_definition())
    data = LaunchData(
        role="dev-cvm",
        team="team-a",
        cvm_id=CVM,
        app_compose=m.app_compose.decode(),
        ssh_authorized_keys=(key,),
        security_cvm_ips=("10.20.1.10",),
    )
    standin.attributes = data.gcp_metadata()
    tdx = SimulatedTdx(pki, image="umbra-dev-cvm")
    loaded = Loaded()
    Agent(
        source=GcpMetadata(standin.url),
        extender=SimulatedRtmr(tdx),
        starter=starter or Started(),
        reporter=None,
        launch_dir=tmp_path / "launch",
        say=(lines.append if lines is not None else lambda _line: None),
        firewall=loaded,
        etc_dir=tmp_path,
        ingress=ingress,
    ).run()
    assert loaded.rulesets == [data.host_firewall]
    return tdx, data


def _info(data: LaunchData, firewall_sha256: str | None) -> SessionInfo:
    return SessionInfo(
        cvm_id=data.cvm_id,
        name="main",
        state=SessionState.running,
        ingress=SshIngress(host="127.0.0.1", port=2222),
        release=measure(dev_definition()).release,
        ssh_authorized_keys=[ALICE],
        host_firewall_sha256=firewall_sha256,
    )


def _client_verifies(
    info: SessionInfo, tdx: SimulatedTdx, log: list[Event], binding: bytes
) -> tuple[str, str]:
    """The checks connect_attested runs, in its order, on one fresh quote."""
    policy = ssh_attest.session_policy(info)
    collateral, root = ssh_attest.collateral_and_root(policy.tee == "simulated")
    verifier = ssh_attest.CapturingVerifier(
        policy, collateral, allow_simulated=root is not None, simulated_root_der=root
    )
    nonce = os.urandom(64)
    verdict = verifier.verify(tdx.quote(nonce), event_log=log, expected_report_data=nonce)
    if not verdict.ok:
        raise Refused(ssh_attest.classify(verdict.reasons), "; ".join(verdict.reasons))
    return ssh_attest.check_host_key(info.cvm_id, verifier.log, binding)


def test_the_client_accepts_a_launched_dev_cvm_and_learns_its_host_key(
    standin: StandIn, client: SimulatedPki, tmp_path: Path
) -> None:
    tdx, data = _boot(standin, client, tmp_path)
    expected = data.expected_events()
    host_key = (tmp_path / "launch/ssh/ssh_host_ed25519_key.pub").read_text().strip()
    boot_id = (tmp_path / "launch/ssh/boot-id").read_text().strip()
    # What the Console records from the launch data it rendered (LaunchData.expected_events()).
    info = _info(data, expected[HOST_FIREWALL_EVENT])
    key, boot = _client_verifies(info, tdx, tdx.event_log(), host_key.encode())
    assert (key, boot) == (host_key, boot_id)


def test_another_or_unrecorded_firewall_is_refused(
    standin: StandIn, client: SimulatedPki, tmp_path: Path
) -> None:
    tdx, data = _boot(standin, client, tmp_path)
    host_key = (tmp_path / "launch/ssh/ssh_host_ed25519_key.pub").read_text().strip()
    other = replace(data, security_cvm_ips=("10.20.1.99",)).host_firewall
    assert other is not None
    for digest, says in (
        (hashlib.sha256(other.encode()).hexdigest(), "not an accepted value"),
        (None, "runtime events not in the policy"),
    ):
        with pytest.raises(Refused) as exc:
            _client_verifies(_info(data, digest), tdx, tdx.event_log(), host_key.encode())
        assert exc.value.check is Check.host_firewall and says in exc.value.reason, digest


def test_a_tampered_firewall_event_in_the_log_is_refused(
    standin: StandIn, client: SimulatedPki, tmp_path: Path
) -> None:
    tdx, data = _boot(standin, client, tmp_path)
    host_key = (tmp_path / "launch/ssh/ssh_host_ed25519_key.pub").read_text().strip()
    info = _info(data, data.expected_events()[HOST_FIREWALL_EVENT])
    forged = make_runtime_event(3, HOST_FIREWALL_EVENT, hashlib.sha256(b"accept all").digest())
    log = [forged if e.name == HOST_FIREWALL_EVENT else e for e in tdx.event_log()]
    with pytest.raises(Refused) as exc:
        _client_verifies(info, tdx, log, host_key.encode())
    # The forged log no longer replays to the quoted RTMR3: nothing in it is believed.
    assert exc.value.check is Check.measurement and "RTMR3" in exc.value.reason
    # And a TD that really extended another ruleset is refused on the firewall itself.
    lying = SimulatedTdx(client, image="umbra-dev-cvm")
    for e in log:
        if e.name:
            lying.extend_runtime_event(e.name, e.payload, e.imr)
    with pytest.raises(Refused) as exc:
        _client_verifies(info, lying, lying.event_log(), host_key.encode())
    assert exc.value.check is Check.host_firewall


def _ingress_config(tmp_path: Path, quote_source: dict[str, str]) -> IngressConfig:
    """The attested ingress as a cloud Dev CVM runs it: launch files and host key from the
    launch agent (never generated by the ingress itself)."""
    launch = tmp_path / "launch"
    return IngressConfig.model_validate(
        {
            "listen": {"host": "127.0.0.1", "port": free_port()},
            "launch_dir": str(launch / "ssh"),
            "state_dir": str(tmp_path / "state"),
            "host_key_file": str(launch / "ssh/ssh_host_ed25519_key"),
            "sandbox": {"netns": f"c12-none-{os.getpid()}"},  # no session is started here
            "quote_source": quote_source,
        }
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the gateway's files are root's")
def test_the_ingress_serves_the_agents_host_key_and_the_client_connects(
    standin: StandIn, client: SimulatedPki, tmp_path: Path
) -> None:
    _tdx, data = _boot(standin, client, tmp_path)
    host_key = (tmp_path / "launch/ssh/ssh_host_ed25519_key.pub").read_text().strip()
    log = str(tmp_path / "launch/event-log.json")
    # TDX: the ingress only checks that the agent bound exactly its key and one boot id.
    assert Ingress(_ingress_config(tmp_path, {"kind": "configfs", "event_log": log})).host_key == (
        host_key
    )
    # Simulated TEE: it replays the agent's log (adding nothing) and serves quotes over aTLS;
    # the client's full connect path (ssh-proxy's) verifies and learns the agent's key.
    qs = {"kind": "simulated", "event_log": log, "simulated_pki": str(tmp_path / "pki")}
    ingress = Ingress(_ingress_config(tmp_path, qs))
    assert [e.name for e in ingress.evidence.event_log() if e.name].count(SSH_HOST_KEY) == 1

    async def connect() -> ssh_attest.AttestedSession:
        server = await ingress.start()
        port = server.sockets[0].getsockname()[1]
        info = _info(data, data.expected_events()[HOST_FIREWALL_EVENT])
        info = info.model_copy(update={"ingress": SshIngress(host="127.0.0.1", port=port)})
        try:
            session = await ssh_attest.connect_attested(info)
            await session.conn.close()
            return session
        finally:
            server.close()
            await server.wait_closed()

    session = asyncio.run(connect())
    boot_id = (tmp_path / "launch/ssh/boot-id").read_text().strip()
    assert (session.host_key, session.boot_id) == (host_key, boot_id)


def _agent_ingress(tmp_path: Path, sandbox: FixedSandbox, starter: Started) -> AttestedIngress:
    return AttestedIngress(
        sandbox,
        starter,
        {"kind": "configfs"},  # what `--tee tdx` gives
        config_dir=tmp_path / "run-ingress",
        state_dir=tmp_path / "state",
    )


def test_the_agent_starts_the_attested_ingress_after_the_compose(
    standin: StandIn, client: SimulatedPki, tmp_path: Path
) -> None:
    started, lines = Started(), []
    ingress = _agent_ingress(tmp_path, FixedSandbox(4242), started)
    _boot(standin, client, tmp_path, ingress=ingress, lines=lines, starter=started)
    assert started.order == ["compose", "ingress"]
    run = tmp_path / "run-ingress"
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    for name in ("config.json", "sandbox.pid"):
        assert stat.S_IMODE((run / name).stat().st_mode) == 0o600, name
    assert (run / "sandbox.pid").read_text() == "4242\n"
    # What `umbra sandbox ingress --config` (the unit's command) loads, strictly.
    config = load_ingress_config(run / "config.json")
    launch = tmp_path / "launch"
    assert (config.listen.host, config.listen.port) == ("0.0.0.0", 8022)  # noqa: S104
    assert config.launch_dir == launch / "ssh"
    assert config.state_dir == tmp_path / "state"
    assert config.host_key_file == launch / "ssh/ssh_host_ed25519_key"
    assert config.quote_source.kind == "configfs"
    assert config.quote_source.event_log == launch / "event-log.json"
    assert config.sandbox.pid_file == run / "sandbox.pid"
    assert (config.sandbox.user, config.sandbox.uid, config.sandbox.home) == (
        "dev",
        1000,
        "/home/dev",
    )
    # The private host key is the agent's file, named, never copied into the config.
    private = (launch / "ssh/ssh_host_ed25519_key").read_bytes()
    assert private not in (run / "config.json").read_bytes()
    assert any("attested SSH ingress started on port 8022" in line for line in lines)


def test_no_sandbox_container_means_no_ingress_and_a_refusal(
    standin: StandIn, client: SimulatedPki, tmp_path: Path
) -> None:
    started, lines = Started(), []
    ingress = _agent_ingress(tmp_path, FixedSandbox(None), started)
    with pytest.raises(LaunchError) as exc:
        _boot(standin, client, tmp_path, ingress=ingress, lines=lines, starter=started)
    assert exc.value.reason is Refusal.INGRESS_FAILED
    assert started.order == ["compose"]  # the unit was never started
    assert not (tmp_path / "run-ingress/config.json").exists()
    assert "attested SSH ingress NOT started" in lines[-1] and "got 0" in lines[-1]


@pytest.mark.skipif(os.geteuid() != 0, reason="LOUD SKIP: needs root (user namespaces, sshd)")
def test_the_agents_ingress_config_serves_a_real_login_into_the_sandbox(
    standin: StandIn, client: SimulatedPki, tmp_path: Path
) -> None:
    """The agent's config drives a real ingress (quote source simulated, since there is no TD)
    into a stand-in sandbox found by its PID file; the client's attested connect is the
    ProxyCommand of a real `ssh`, and the command runs inside the sandbox as its user."""
    harness.require_tools()
    key_file, key = harness.keypair(tmp_path)
    started = Started()
    with harness.sandbox() as box:
        _tdx, data = _boot(
            standin,
            client,
            tmp_path,
            key=key,
            ingress=_agent_ingress(tmp_path, FixedSandbox(box.pid), started),
            starter=started,
        )
        doc = json.loads((tmp_path / "run-ingress/config.json").read_text())
        # Only what the stand-ins need changes: no TD (simulated quotes over the agent's log),
        # a free loopback port, the stand-in sandbox's home (it shares the host's files).
        doc["quote_source"] |= {"kind": "simulated", "simulated_pki": str(tmp_path / "pki")}
        doc["listen"] = {"host": "127.0.0.1", "port": free_port()}
        doc["sandbox"] |= {"home": str(box.home), "sessions_dir": str(box.sessions)}
        assert doc["sandbox"]["pid_file"] == str(tmp_path / "run-ingress/sandbox.pid")
        ingress = Ingress(IngressConfig.model_validate(doc))
        info = _info(data, data.expected_events()[HOST_FIREWALL_EVENT])
        info = info.model_copy(
            update={"ingress": SshIngress(**doc["listen"]), "ssh_authorized_keys": [key]}
        )
        done = _ssh_through(ingress, info, tmp_path, key_file, "id -u; readlink /proc/self/ns/net")
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["1000", os.readlink(f"/proc/{box.pid}/ns/net")]
        assert ingress.stats.sessions == 1


def _ssh_through(
    ingress: Ingress, info: SessionInfo, tmp_path: Path, key_file: Path, command: str
) -> subprocess.CompletedProcess[str]:
    """A real `ssh` whose ProxyCommand is the client's attested connect to this ingress, with
    the agent's attested host key as the only known host."""
    (tmp_path / "info.json").write_text(info.model_dump_json())
    host_key = (tmp_path / "launch/ssh/ssh_host_ed25519_key.pub").read_text().split()
    known = tmp_path / "known_hosts"
    known.write_text(f"umbra-{CVM} {host_key[0]} {host_key[1]}\n")
    (tmp_path / "proxy.py").write_text(PROXY)
    proxy = f"{sys.executable} {tmp_path / 'proxy.py'} {tmp_path / 'info.json'}"

    async def login() -> subprocess.CompletedProcess[str]:
        server = await ingress.start()
        try:
            return await asyncio.to_thread(
                subprocess.run,
                ["ssh", "-F", "/dev/null", "-i", str(key_file), "-o", "IdentitiesOnly=yes",
                 "-o", f"ProxyCommand={proxy}", "-o", f"HostKeyAlias=umbra-{CVM}",
                 "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known}",
                 "-o", "BatchMode=yes", f"root@umbra-{CVM}", command],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(login())


# The client's attested connect (ssh-proxy's checks, from a SessionInfo file instead of the
# Console), then the stdio relay: ssh's ProxyCommand.
PROXY = """
import asyncio, sys
from umbra.cli import ssh_proxy
from umbra.cli.ssh_attest import connect_attested
from umbra.attest.session_info import SessionInfo
info = SessionInfo.model_validate_json(open(sys.argv[1]).read())
async def main():
    session = await connect_attested(info)
    await ssh_proxy._relay(session.conn)
asyncio.run(main())
"""


def test_the_os_image_installs_the_ingress_unit_for_the_agent_only(tmp_path: Path) -> None:
    units = tmp_path / "system"
    (units / "multi-user.target.wants").mkdir(parents=True)
    os_image.install_ingress_unit(units)
    unit = (units / launch_ingress.INGRESS_UNIT).read_text()
    config = launch_ingress.INGRESS_DIR / launch_ingress.CONFIG_NAME
    assert f"umbra sandbox ingress --config {config}" in unit
    assert f"ConditionPathExists={config}" in unit
    assert "[Install]" not in unit and not any((units / "multi-user.target.wants").iterdir())
    # Started means listening (its READY=1: sandbox/sd_notify.py), so the agent's `started` line
    # and the ready report after it mean `umbra ssh` works (Type=exec: minutes of resets on TCG).
    assert "Type=notify" in unit and "NotifyAccess=main" in unit
    # systemd's bound on that start is the one the agent's `systemctl start` outlasts.
    assert f"TimeoutStartSec={launch_ingress.START_TIMEOUT}" in unit.splitlines()
    # The agent starts it from inside its own (still activating) oneshot and waits: no ordering
    # after the agent, or that start job would wait for the agent forever.
    after = [ln for ln in unit.splitlines() if ln.startswith("After=")]
    assert after == ["After=docker.service"]
    for name in ("ssh.service", "ssh.socket"):  # Debian's own sshd never runs
        assert os.readlink(units / name) == "/dev/null"
    # Nor systemd's generated sshd sockets (AF_UNIX, and AF_VSOCK: reachable by the host).
    assert os.readlink(tmp_path / "system-generators/systemd-ssh-generator") == "/dev/null"
    for name in ("gcp.yaml", "azure.yaml"):
        assert "openssh-server" in os_image.load_os_definition(os_image.OS_DIR / name).packages


def _tiny_image(tmp_path: Path, tag: str) -> None:
    """A container image with only bash and three coreutils (and their libraries), imported
    from a tar of the host's files: no registry, no build."""
    import tarfile

    tools = ["/bin/bash", "/usr/bin/id", "/usr/bin/readlink", "/usr/bin/sleep"]
    libs = subprocess.run(["ldd", *tools], capture_output=True, text=True, check=True).stdout
    files = set(tools) | {w for w in libs.split() if w.startswith("/") and not w.endswith(":")}
    archive = tmp_path / "rootfs.tar"
    with tarfile.open(archive, "w", dereference=True) as tar:
        for path in sorted(files):
            tar.add(path, arcname=path.lstrip("/"), recursive=False)
    subprocess.run(["docker", "import", str(archive), tag], check=True, capture_output=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="LOUD SKIP: needs root (Docker, sshd)")
def test_the_agent_finds_a_real_sandbox_container_and_the_ingress_logs_into_it(
    standin: StandIn, client: SimulatedPki, tmp_path: Path
) -> None:
    """A real sandbox process (a container, under runc here: no user namespace of its own)
    whose pid file the agent's `PidFileSandbox` reads, as runc's on the dev host: the ingress
    configured by the agent runs a real ssh session inside it, and after a restart (the pid file
    rewritten, as runc does) enters the new process, never the stale one."""
    from .conftest import docker_up

    docker_up()
    harness.require_tools()
    name = f"uing-sandbox-{os.getpid()}"
    key_file, key = harness.keypair(tmp_path)
    try:
        _tiny_image(tmp_path, f"{name}:test")
        subprocess.run(
            ["docker", "run", "--detach", "--name", name, "--network", "none",
             "--label", f"com.docker.compose.project={name}",
             "--label", "com.docker.compose.service=sandbox",
             f"{name}:test", "/usr/bin/sleep", "600"],
            check=True, capture_output=True,
        )  # fmt: skip
        inspect = ["docker", "inspect", "--format", "{{.State.Pid}}", name]
        pid = subprocess.run(inspect, capture_output=True, text=True, check=True).stdout.strip()
        pid_file = tmp_path / "sandbox.pid"
        pid_file.write_text(f"{pid}\n")
        started = Started()
        ingress_steps = AttestedIngress(
            PidFileSandbox(pid_file),
            started,
            {"kind": "configfs"},
            config_dir=tmp_path / "run-ingress",
            state_dir=tmp_path / "state",
        )
        _tdx, data = _boot(
            standin, client, tmp_path, key=key, ingress=ingress_steps, starter=started
        )
        assert not (tmp_path / "run-ingress/sandbox.pid").exists()
        doc = json.loads((tmp_path / "run-ingress/config.json").read_text())
        doc["quote_source"] |= {"kind": "simulated", "simulated_pki": str(tmp_path / "pki")}
        doc["listen"] = {"host": "127.0.0.1", "port": free_port()}
        doc["sandbox"] |= {"home": "/"}  # the tiny image has no /home/dev
        ingress = Ingress(IngressConfig.model_validate(doc))
        info = _info(data, data.expected_events()[HOST_FIREWALL_EVENT]).model_copy(
            update={"ingress": SshIngress(**doc["listen"]), "ssh_authorized_keys": [key]}
        )
        done = _ssh_through(ingress, info, tmp_path, key_file, "id -u; readlink /proc/self/ns/net")
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["1000", os.readlink(f"/proc/{pid}/ns/net")]
        # The sandbox restarts: a new process in new namespaces, its pid file rewritten (runc
        # does it on the dev host). The ingress reads it per connection; never the stale PID.
        subprocess.run(["docker", "restart", "-t", "1", name], check=True, capture_output=True)
        new = subprocess.run(inspect, capture_output=True, text=True, check=True).stdout.strip()
        assert new != pid
        pid_file.write_text(f"{new}\n")
        again = _ssh_through(ingress, info, tmp_path, key_file, "readlink /proc/self/ns/net")
        assert again.returncode == 0, again.stderr
        assert again.stdout.split() == [os.readlink(f"/proc/{new}/ns/net")]
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
        subprocess.run(["docker", "rmi", "-f", f"{name}:test"], capture_output=True)


def test_on_the_dev_host_the_ingress_reads_runcs_own_pid_file(
    standin: StandIn, client: SimulatedPki, tmp_path: Path
) -> None:
    """The dev host's sandbox (sandbox/dev_host.py): the ingress's `pid_file` is runc's pid file,
    which the supervisor's restarts rewrite; the agent writes no copy that could go stale."""
    import json
    import os

    from umbra.images.launch_ingress import PidFileSandbox

    pid_file = tmp_path / "dev-host/sandbox.pid"
    pid_file.parent.mkdir()
    locator = PidFileSandbox(pid_file)
    with pytest.raises(SandboxLocateError, match="no sandbox pid"):
        locator.pid()
    pid_file.write_text("999999999\n")
    with pytest.raises(SandboxLocateError, match="the sandbox is not running"):
        locator.pid()
    pid_file.write_text(f"{os.getpid()}\n")
    started = Started()
    ingress = AttestedIngress(
        locator, started, {"kind": "configfs"},
        config_dir=tmp_path / "run-ingress", state_dir=tmp_path / "state",
    )  # fmt: skip
    _boot(standin, client, tmp_path, ingress=ingress, starter=started)
    config = json.loads((tmp_path / "run-ingress/config.json").read_text())
    assert config["sandbox"]["pid_file"] == str(pid_file)
    assert config["sandbox"]["sessions_dir"] == "/run/umbra-sessions"
    assert "docker" not in config["sandbox"]
    assert not (tmp_path / "run-ingress/sandbox.pid").exists()
