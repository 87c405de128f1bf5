"""The rendered Dev CVM compose file, run for real: the launch agent (simulated TEE) measures it and
starts it with the CVM's own runner (Debian's docker-compose 1.29.2 via
umbra.images.compose_runner) on Debian's docker.io, with the images built by this session and
loaded from their archives (no registry). Runtime: runc, because sysbox is absent here (said in
the output). From inside the sandbox container: no route out, no host service reachable (the
bridge gateway included, TCP and UDP), DNS dead; the agents start.

The compose file mounts absolute launch paths (/run/umbra/launch/...), so the test owns that
directory for its duration and refuses to run if something else already does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from umbra.attest.eventlog import load_event_log, replay
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.components.launch_data import LaunchData
from umbra.images import host_firewall, image_store
from umbra.images.build import BuildResult
from umbra.images.compose_runner import ComposeRunner
from umbra.images.launch_agent import Agent, ComposeRunnerStart, SimulatedRtmr
from umbra.images.measure import expected_rtmr3, instance_events, measure

from ..sandbox.fixtures import dev_definition
from .conftest import docker_up
from .test_docker_isolation import PROBE, host_services  # noqa: F401 -- the fixture

pytestmark = pytest.mark.timeout(1500)

LAUNCH = Path("/run/umbra/launch")
ALICE = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice"


@dataclass(frozen=True)
class Given:
    meta: dict[str, str]

    def fetch(self) -> dict[str, str]:
        return self.meta


def _docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {done.stderr.strip()}")
    return done


@pytest.fixture
def launch_dir() -> Iterator[Path]:
    if LAUNCH.exists():
        pytest.fail(f"{LAUNCH} exists: another Dev CVM (or test) owns it on this machine")
    try:
        yield LAUNCH
    finally:
        shutil.rmtree(LAUNCH, ignore_errors=True)


def test_rendered_dev_cvm_compose_runs_isolated_under_docker_compose(
    runtime_builds: tuple[Path, dict[str, dict[str, str]], dict[str, dict[str, str]]],
    sandbox_ci_build: BuildResult,
    host_services: tuple[int, int, list[bytes]],  # noqa: F811
    launch_dir: Path,
    tmp_path: Path,
) -> None:
    docker_up()
    out, images, _ = runtime_builds
    (sandbox,) = sandbox_ci_build.images
    archives = tmp_path / "images"
    archives.mkdir()
    for name in ("forwarder", "sshd"):
        os.link(out / images[name]["archive"], archives / images[name]["archive"])
    os.link(sandbox.archive, archives / sandbox.archive.name)
    refs = {
        "sandbox": sandbox.ref,
        "forwarder": f"umbra/forwarder@{images['forwarder']['manifest_digest']}",
        "sshd": f"umbra/sshd@{images['sshd']['manifest_digest']}",
    }
    octet = 100 + os.getpid() % 100
    definition = dev_definition(
        images=refs,
        allow_simulated=True,
        sandbox_subnet=f"10.232.{octet}.0/24",
        sessions_subnet=f"10.233.{octet}.0/24",
        ssh_port=18000 + os.getpid() % 1000,
    )
    m = measure(definition)
    data = LaunchData(
        role="dev-cvm",
        team="acme",
        cvm_id="u12-dev",
        app_compose=m.app_compose.decode(),
        ssh_authorized_keys=(ALICE,),
    )
    tdx = SimulatedTdx(SimulatedPki.generate(), image="umbra-dev-cvm")
    lines: list[str] = []
    state = tmp_path / "compose"
    agent = Agent(
        source=Given(data.as_metadata()),
        extender=SimulatedRtmr(tdx),
        starter=ComposeRunnerStart(archives, state, allow_runc=True, say=lines.append),
        reporter=None,
        launch_dir=launch_dir,
        say=lines.append,
    )
    gw = f"10.232.{octet}.1"
    tcp, udp, got = host_services
    runner = ComposeRunner(state, {})
    host_firewall.apply()  # on the CVM its unit runs before docker.service
    try:
        agent.run()
        print("\n".join(lines))
        # Stated plainly: not the production runtime.
        assert "umbra-compose: services.sandbox: runtime runc, because sysbox-runc is absent" in (
            "\n".join(lines)
        )
        events = instance_events("dev-cvm", "u12-dev", [ALICE])
        want = expected_rtmr3(m.events() + events).hex()
        log = load_event_log((launch_dir / "event-log.json").read_bytes())
        assert replay(log)[3].hex() == want == tdx.rtmrs()[3].hex()
        ps = _docker("ps", "--filter", "label=com.docker.compose.project=umbra-dev",
                     "--format", "{{.Names}} {{.Image}} {{.Status}}").stdout  # fmt: skip
        print(ps)
        assert {line.split()[0] for line in ps.splitlines()} == {
            "umbra-dev_sandbox_1", "umbra-dev_forwarder_1", "umbra-dev_sshd_1"}  # fmt: skip
        inspect = json.loads(_docker("inspect", "umbra-dev_sandbox_1").stdout)[0]
        # The pinned manifest digest resolved to exactly the built image (its config digest).
        assert inspect["Image"] == sandbox.config_digest
        assert inspect["HostConfig"]["Runtime"] == "runc"
        _wait_running("umbra-dev_sandbox_1")
        assert inspect["Config"]["Env"].count(f"HTTPS_PROXY=http://10.232.{octet}.2:3128") == 1
        probe = _exec(PROBE, gw, str(tcp), str(udp))
        print("from the sandbox:", probe)
        assert probe["gateway_tcp"].startswith("error:")
        assert probe["gateway_udp"].startswith("error:") and got == []
        assert probe["internet_tcp"].startswith("error:")
        assert probe["dns"].startswith("error:")
        agents = _docker("exec", "-u", "dev", "umbra-dev_sandbox_1", "bash", "-lc",
                         "claude --version && codex --version")  # fmt: skip
        print(agents.stdout)
        assert "Claude Code" in agents.stdout and "codex" in agents.stdout.lower()
    finally:
        try:
            runner.down("umbra-dev")
        finally:
            host_firewall.remove()
            for ref in (sandbox.config_digest, images["forwarder"]["config_digest"]):
                _docker("rmi", "-f", ref, check=False)


def _wait_running(name: str) -> None:
    """The sandbox's init must stay up (restart: unless-stopped would hide a crash loop)."""
    for _ in range(30):
        state = json.loads(_docker("inspect", name).stdout)[0]["State"]
        if state["Running"] and not state["Restarting"] and state["RestartCount"] == 0:
            time.sleep(2)
            again = json.loads(_docker("inspect", name).stdout)[0]["State"]
            if again["Running"] and again["RestartCount"] == 0:
                return
        time.sleep(1)
    logs = _docker("logs", "--tail", "20", name, check=False)
    raise AssertionError(f"{name} does not stay up: {state}\n{logs.stdout}{logs.stderr}")


def _exec(script: str, *args: str) -> dict[str, Any]:
    done = _docker("exec", "-u", "dev", "umbra-dev_sandbox_1", "python3.12", "-c", script, *args)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_image_store_refuses_an_inconsistent_archive(tmp_path: Path) -> None:
    bad = tmp_path / "x.docker.tar"
    bad.write_bytes(b"not a tar")
    with pytest.raises(image_store.ImageStoreError, match="not an umbra docker-archive"):
        image_store.read_archive(bad)
