"""The rendered Dev CVM and Security CVM compose files, run for real: for each, the launch agent
(simulated TEE) measures it and starts it with the CVM's own runner (Debian's docker-compose
1.29.2 via umbra.images.compose_runner) on Debian's docker.io, with the images built by this
session and loaded from their archives (no registry). Runtime: runc, because sysbox is absent here
(said in the output). HTTPS from the sandbox verifies with no CA option, against the
interception CA the forwarder fetched over aTLS.

The Security CVM is a `tee: simulated` release (its proxy quotes with the simulator, its test
options reach the host's origin) against the real Console (SQLite, over TLS with its own CA from
launch data): it enrolls with the one-time token the launch agent wrote, pulls the signed bundle
and the Dev CVM's attachment, and ships its traffic log there. The Dev CVM's forwarder attests it
(the measured Security release, compose hash included) before relaying. From inside the sandbox
container: no route out, no host service reachable (the bridge gateway included, TCP and UDP),
DNS dead, HTTP only through forwarder -> proxy -> origin, recorded at the Console against the Dev
CVM; the agents start.

The compose files mount absolute launch paths (/run/umbra/launch/...), so the test owns that
directory for its duration and refuses to run if something else already does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.console import enroll
from tests.console.helpers import Server, new_team, start_server
from tests.console.oidc_issuer import LocalIssuer
from tests.proxy import harness
from umbra.attest.collateral import StaticCollateral
from umbra.attest.eventlog import load_event_log, replay
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpccs import SimulatedPccs
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verifier
from umbra.components.launch_data import LaunchData
from umbra.console.release import AttestedReleaseVerifier
from umbra.images import host_firewall, image_store
from umbra.images.build import BuildResult
from umbra.images.compose_runner import ComposeRunError, ComposeRunner, lower
from umbra.images.launch_agent import (
    SPOOL,
    WORKSPACE,
    Agent,
    ComposeRunnerStart,
    LogOnly,
    SimulatedRtmr,
)
from umbra.images.measure import (
    boot_events,
    boot_events_of,
    expected_rtmr3,
    instance_events,
    measure,
)
from umbra.policy.bundle import generate_key, payload_document, sign_bundle
from umbra.policy.loader import load_policy_dir

from ..proxy.harness import TestCA as OriginCA
from ..sandbox.fixtures import dev_definition, security_definition
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


def bridge_gateway() -> str:
    """The host's address on Docker's default bridge. Docker 28's client shows no IPAM `Gateway`
    for a bridge a 20.10 daemon made (and a daemon may leave it unset), so the address is read
    from the bridge's interface (its `com.docker.network.bridge.name` option, a field both 20.10
    and 28 show), falling back to the IPAM gateway where one is given."""
    doc = json.loads(_docker("network", "inspect", "bridge").stdout)[0]
    ifname = (doc.get("Options") or {}).get("com.docker.network.bridge.name", "docker0")
    shown = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "dev", ifname],
        capture_output=True, text=True, timeout=20, check=False,
    ).stdout.split()  # fmt: skip
    if "inet" in shown:
        return shown[shown.index("inet") + 1].split("/")[0]
    gateways = [
        c["Gateway"] for c in (doc.get("IPAM") or {}).get("Config") or [] if c.get("Gateway")
    ]
    assert gateways, f"no address for Docker's default bridge ({ifname}): {doc.get('IPAM')}"
    return str(gateways[0])


@pytest.fixture
def launch_dir() -> Iterator[Path]:
    # The compose also binds the data disk's workspace directory (an absolute host path).
    # The Security compose binds the data disk's spool directory likewise.
    for owned in (LAUNCH, WORKSPACE, SPOOL):
        if owned.exists():
            pytest.fail(f"{owned} exists: another Dev CVM (or test) owns it on this machine")
    # The agent creates the workspace with its parents: remove the topmost one it created.
    created = WORKSPACE
    while not created.parent.exists():
        created = created.parent
    try:
        yield LAUNCH
    finally:
        shutil.rmtree(LAUNCH, ignore_errors=True)
        shutil.rmtree(SPOOL, ignore_errors=True)
        shutil.rmtree(created, ignore_errors=True)


def test_rendered_dev_and_security_cvm_compose_run_isolated_under_docker_compose(
    runtime_builds: tuple[Path, dict[str, dict[str, str]], dict[str, dict[str, str]]],
    sandbox_ci_build: BuildResult,
    host_services: tuple[int, int, list[bytes]],  # noqa: F811
    launch_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docker_up()
    out, images, _ = runtime_builds
    (sandbox,) = sandbox_ci_build.images
    archives = tmp_path / "images"
    archives.mkdir()
    for name in ("forwarder",):
        os.link(out / images[name]["archive"], archives / images[name]["archive"])
    os.link(sandbox.archive, archives / sandbox.archive.name)
    refs = {
        "sandbox": sandbox.ref,
        "forwarder": f"umbra/forwarder@{images['forwarder']['manifest_digest']}",
    }
    pki = enroll.pki()  # the test Console's enrollment verifiers trust this simulated root
    # The host as containers see it on Docker's default bridge: where the Console and the origin
    # listen (the Security CVM reaches them from its own bridge through the host).
    host_ip = bridge_gateway()
    octet = 100 + os.getpid() % 100
    lines: list[str] = []
    state = tmp_path / "compose"
    gw = f"10.232.{octet}.1"
    tcp, udp, got = host_services
    runner = ComposeRunner(state, {})
    sec: SecurityCvm | None = None
    host_firewall.apply()  # on the CVM its unit runs before docker.service
    try:
        with (
            SimulatedPccs(pki, int(time.time()) - 60, host="0.0.0.0") as pccs,  # noqa: S104
            _console(tmp_path / "console", host_ip, monkeypatch) as (server, ca, issuer),
            contextlib.ExitStack() as down,
        ):
            sec = SecurityCvm(tmp_path / "sec", pki, server, ca, issuer, host_ip, out, images)
            # Both composes go down (Dev first) while the Console still answers the proxy.
            down.callback(sec.stop, runner)
            down.callback(runner.down, "umbra-dev")
            sec.start(launch_dir, state, lines)
            definition = dev_definition(
                images=refs,
                allow_simulated=True,
                security_cvm={"host": host_ip, "port": sec.tunnel_port},
                security_cvm_release=sec.release,
                pccs_urls=[f"http://{host_ip}:{pccs.url.rsplit(':', 1)[1]}"],
                tunnels=[],
                sandbox_subnet=f"10.232.{octet}.0/24",
                uplink_subnet=f"10.234.{octet}.0/29",
            )
            m = measure(definition)
            data = LaunchData(
                role="dev-cvm",
                team=sec.team.name,
                cvm_id=sec.dev_cvm_id,
                app_compose=m.app_compose.decode(),
                ssh_authorized_keys=(ALICE,),
            )
            # Not launch data (no long-lived credential there): the forwarder enrolls at first
            # start and keeps the credential in its state volume. This engine has no configfs-tsm
            # to quote with, so the test enrolls the Dev CVM at the Console as its simulated TD
            # (same routes, one-time token) and puts the credential where the enrollment would.
            _seed_forwarder_state(sec.dev_credential)
            fwd_dir = launch_dir / "forwarder"
            fwd_dir.mkdir(parents=True)
            (fwd_dir / "simulated-root.der").write_bytes(pki.root_der)
            for f in fwd_dir.iterdir():
                os.chown(f, 65534, 65534)
            tdx = SimulatedTdx(pki, image="umbra-dev-cvm")
            agent = Agent(
                source=Given(data.as_metadata()),
                extender=SimulatedRtmr(tdx),
                starter=ComposeRunnerStart(archives, state, allow_runc=True, say=lines.append),
                reporter=None,
                launch_dir=launch_dir,
                say=lines.append,
                workspace_dir=WORKSPACE,
            )
            agent.run()
            _check_the_running_dev_cvm(m, tdx, launch_dir, lines, sandbox, octet, sec.dev_cvm_id)
            # The user's work lands in the data disk's directory, outside docker's data-root.
            _sh("echo u12-work > ~/work/note && test -O ~/work")
            assert (WORKSPACE / "note").read_text() == "u12-work\n"
            probe = _exec(PROBE, gw, str(tcp), str(udp))
            print("from the sandbox:", probe)
            assert probe["gateway_tcp"].startswith("error:")
            assert probe["gateway_udp"].startswith("error:") and got == []
            assert probe["internet_tcp"].startswith("error:")
            assert probe["dns"].startswith("error:")
            # The host's own address, directly: unreachable. Through the proxy: denied by policy.
            url = f"http://{host_ip}:{sec.origin_port}/allowed"
            assert _sh(f"curl -sS -m 5 --noproxy '*' {url}", check=False).returncode != 0
            assert _sh(f"curl -sS -m 30 {url}").stdout.startswith("umbra: denied")
            # HTTP only through forwarder -> (attested) Security CVM proxy -> origin.
            allowed = _sh(f"curl -sS -m 30 http://origin.test:{sec.origin_port}/allowed")
            assert allowed.stdout == "u12-origin-ok"
            denied = _sh(
                f"curl -sS -m 30 -o /dev/null -w '%{{http_code}}' "
                f"http://denied.test:{sec.origin_port}/x",
                check=False,
            )
            print("denied:", denied.stdout, denied.stderr)
            assert denied.stdout.startswith("4") and "/x" not in sec.origin_paths
            assert "/allowed" in sec.origin_paths
            _check_https_trusts_the_attested_ca(sec)
            # The proxy's records reach the Console (shipped with its enrolled credential),
            # attributed to the Dev CVM, its owner and team from the Console's attachments.
            records = sec.traffic(lambda r: r.get("path") == "/allowed")
            print("traffic records:", [(r.get("host"), r.get("path")) for r in records])
            assert records and all(r["cvm_id"] == sec.dev_cvm_id for r in records)
            assert records[0]["owner"] == sec.team.dev_subject
            assert records[0]["team"] == sec.team.name
            # sudo apt-get install through the proxy, from the stand-in apt repo.
            repo = f"http://origin.test:{sec.origin_port}/debian"
            apt = _sh(
                f"echo 'deb [trusted=yes] {repo} ./' | sudo tee /tmp/u12.list >/dev/null && "
                "opts='-o Dir::Etc::sourcelist=/tmp/u12.list -o Dir::Etc::sourceparts=- "
                f"-o Acquire::http::Proxy=http://10.232.{octet}.2:3128' && "
                "sudo apt-get $opts update -q && sudo apt-get $opts install -y -q u12-hello && "
                "cat /usr/share/u12-hello/hello"
            )
            assert apt.stdout.strip().endswith("u12-hello-installed"), apt.stdout + apt.stderr
            agents = _docker("exec", "-u", "dev", "umbra-dev_sandbox_1", "bash", "-lc",
                             "claude --version && codex --version")  # fmt: skip
            print(agents.stdout)
            assert "Claude Code" in agents.stdout and "codex" in agents.stdout.lower()
            # The forwarder verified the Security CVM's (simulated) quote before relaying.
            assert "umbra tunnel endpoint listening" in sec.log()
            _wait_running("umbra-security_proxy_1")  # never restarted
            assert pccs.requests, "the forwarder fetched no collateral: it did not verify"
            sec.check_secrets_kept()
            assert b"BEGIN CERTIFICATE" in sec.interception_ca()  # made in its own volume
    finally:
        try:
            runner.down("umbra-dev")
            _docker("volume", "rm", "-f", "umbra-dev_forwarder-state", check=False)
        finally:
            if sec is not None:
                sec.stop(runner)
            host_firewall.remove()
            for ref in (
                sandbox.config_digest,
                images["forwarder"]["config_digest"],
                images["proxy"]["config_digest"],
            ):
                _docker("rmi", "-f", ref, check=False)


def _seed_forwarder_state(credential: str) -> None:
    """The `forwarder-state` volume as docker-compose 1.29 names and labels it, holding the tunnel
    credential (0600, the forwarder's uid) as a completed enrollment leaves it."""
    volume = "umbra-dev_forwarder-state"
    _docker("volume", "rm", "-f", volume, check=False)
    _docker("volume", "create", "--label", "com.docker.compose.project=umbra-dev",
            "--label", "com.docker.compose.volume=forwarder-state", volume)  # fmt: skip
    data = Path(_docker("volume", "inspect", "-f", "{{.Mountpoint}}", volume).stdout.strip())
    target = data / "tunnel-credential"
    target.write_text(credential + "\n")
    os.chmod(target, 0o600)
    os.chown(target, 65534, 65534)


def _check_the_running_dev_cvm(
    m: Any,
    tdx: SimulatedTdx,
    launch_dir: Path,
    lines: list[str],
    sandbox: Any,
    octet: int,
    cvm_id: str,
) -> None:
    print("\n".join(lines))
    # Stated plainly: not the production runtime.
    assert "umbra-compose: services.sandbox: runtime runc, because sysbox-runc is absent" in (
        "\n".join(lines)
    )
    log = load_event_log((launch_dir / "event-log.json").read_bytes())
    boot = boot_events_of("dev-cvm", log)  # this boot's id and host key, shape-checked
    assert boot is not None
    events = instance_events("dev-cvm", cvm_id, [ALICE]) + boot_events("dev-cvm", *boot)
    want = expected_rtmr3(m.events() + events).hex()
    assert replay(log)[3].hex() == want == tdx.rtmrs()[3].hex()
    ps = _docker("ps", "--filter", "label=com.docker.compose.project=umbra-dev",
                 "--format", "{{.Names}} {{.Status}}").stdout  # fmt: skip
    print(ps)
    assert {line.split()[0] for line in ps.splitlines()} == {
        "umbra-dev_sandbox_1", "umbra-dev_forwarder_1"}  # fmt: skip
    inspect = json.loads(_docker("inspect", "umbra-dev_sandbox_1").stdout)[0]
    # The pinned manifest digest resolved to exactly the built image (its config digest).
    assert inspect["Image"] == sandbox.config_digest
    assert inspect["HostConfig"]["Runtime"] == "runc"
    assert f"HTTPS_PROXY=http://10.232.{octet}.2:3128" in inspect["Config"]["Env"]
    for service in ("sandbox", "forwarder"):
        _wait_running(f"umbra-dev_{service}_1")
    # No container publishes a port: SSH is the attested ingress's, a host process.
    for service in ("sandbox", "forwarder"):
        ports = json.loads(_docker("inspect", f"umbra-dev_{service}_1").stdout)[0]
        assert not ports["HostConfig"]["PortBindings"], service


def _sh(cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = _docker("exec", "-u", "dev", "umbra-dev_sandbox_1", "bash", "-c", cmd, check=False)
    if check and done.returncode != 0:
        logs = _docker("logs", "--tail", "30", "umbra-dev_forwarder_1", check=False)
        raise AssertionError(
            f"in the sandbox: {cmd}: {done.stdout}{done.stderr}\nforwarder: {logs.stderr}"
        )
    return done


def _wait_running(name: str) -> None:
    """The sandbox's init must stay up (restart: unless-stopped would hide a crash loop)."""
    state: dict[str, Any] = {}
    for _ in range(30):
        doc = json.loads(_docker("inspect", name).stdout)[0]
        state = doc["State"] | {"RestartCount": doc["RestartCount"]}
        if state["Running"] and not state["Restarting"] and state["RestartCount"] == 0:
            time.sleep(2)
            again = json.loads(_docker("inspect", name).stdout)[0]
            if again["State"]["Running"] and again["RestartCount"] == 0:
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


@contextlib.contextmanager
def _console(
    d: Path, host_ip: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Server, str, LocalIssuer]]:
    """The real Console (embedded SQLite) over TLS on every address, its certificate naming the
    bridge gateway the Security CVM dials; this process trusts exactly its CA."""
    d.mkdir()
    ca = harness.TestCA(d)
    cert, key = ca.issue(["console.umbra.test"], ips=(host_ip,))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.cert_path))  # httpx clients of this process
    issuer = LocalIssuer()
    db = d / "console.db"
    server = start_server("sqlite", f"sqlite:///{db}", db, issuer.url, generate_key(), d,
                          listen="0.0.0.0", tls=(cert, key, host_ip))  # fmt: skip # noqa: S104
    try:
        yield server, ca.cert_path.read_text(), issuer
    finally:
        server.stop()
        issuer.close()


class SecurityCvm:
    """The rendered Security CVM compose of a `tee: simulated` release, started by the launch
    agent like the Dev CVM's, against the real Console: a team with this Security CVM (created,
    not enrolled: the proxy enrolls with the one-time token the launch agent writes), a Dev CVM
    attached to it with the `testing` profile of a signed bundle, an origin and an apt repository
    on the host (reached through the proxy's test options: a simulated release only)."""

    def __init__(
        self,
        d: Path,
        pki: SimulatedPki,
        server: Server,
        server_ca: str,
        issuer: LocalIssuer,
        host_ip: str,
        out: Path,
        images: dict[str, dict[str, str]],
    ) -> None:
        self.d, self.pki, self.server, self.server_ca = d, pki, server, server_ca
        self.stopped = False
        d.mkdir()
        self.archives = d / "images"
        self.archives.mkdir()
        os.link(out / images["proxy"]["archive"], self.archives / images["proxy"]["archive"])
        self.tunnel_port = _free_port()
        self.origin_paths: list[str] = []
        self.origin = _origin(d / "www", self.origin_paths)
        self.origin_port = self.origin.server_address[1]
        self.tls_origin = _tls_origin(d / "tls")
        self.repo_head = subprocess.run(
            ["git", "-C", str(d / "tls/www/repo.git"), "rev-parse", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        self.tls_port = self.tls_origin.server_address[1]
        self.team = new_team(server, issuer)
        made = self.team.admin.post(f"/api/v1/teams/{self.team.name}/cvms",
                                    json={"name": "usc-sec", "kind": "security"})  # fmt: skip
        assert made.status_code == 201, made.text
        self.cvm_id: str = made.json()["id"]
        minted = self.team.admin.post(f"/api/v1/cvms/{self.cvm_id}/enrollment-token")
        assert minted.status_code == 201, minted.text
        self.token: str = minted.json()["token"]
        keys = [Path(k).read_text() for k in server.settings.bundle_public_keys]
        self.definition = security_definition(
            images={"proxy": f"umbra/proxy@{images['proxy']['manifest_digest']}"},
            console_url=server.url,
            console_ca=True,
            bundle_keys=keys,
            tunnel_port=self.tunnel_port,
            simulated={},
            test_options={
                "allow_upstream": [f"{host_ip}/32"],
                "resolver": {"origin.test": [host_ip], "denied.test": [host_ip]},
                "upstream_ca": (d / "tls" / "origin-ca.pem").read_text(),
            },
        )
        self.measured = measure(self.definition)
        # The Console admits this Security CVM's enrollment and secret release only for the
        # measured release (compose hash included), on the simulated root.
        verifier = AttestedReleaseVerifier(
            Verifier(
                MeasurementPolicy(release=self.measured.release),
                StaticCollateral(pki.collateral(int(time.time()) - 3600)),
                allow_simulated=True,
                simulated_root_der=pki.root_der,
            )
        )
        server.console.enrollment_verifiers["security"] = verifier
        server.console.release_verifier = verifier
        policies = d / "policies"
        policies.mkdir()
        (policies / "testing.yaml").write_text(
            "apiVersion: umbra/v1\nkind: Profile\nname: testing\negress:\n"
            f"  - id: origin\n    allow: {{hosts: [origin.test], schemes: [http], "
            f"ports: [{self.origin_port}]}}\n"
            f"  - id: origin-tls\n    allow: {{hosts: [origin.test], schemes: [https], "
            f"ports: [{self.tls_port}]}}\n"
        )
        compiled = [loaded.compiled for loaded in load_policy_dir(policies).profiles.values()]
        bundle = sign_bundle(payload_document(compiled, 1, "usc"), [server.bundle_key])
        assert self.team.upload(1, bundle).status_code == 201
        dev = self.team.dev.post(f"/api/v1/teams/{self.team.name}/cvms",
                                 json={"name": "usc-dev", "security_cvm_id": self.cvm_id})  # fmt: skip
        assert dev.status_code == 201, dev.text
        self.dev_cvm_id: str = dev.json()["id"]
        attached = self.team.admin.put(f"/api/v1/cvms/{self.dev_cvm_id}/profiles",
                                       json={"profiles": ["testing"]})  # fmt: skip
        assert attached.status_code == 200, attached.text
        self.dev_credential = enroll.enroll(
            server.url, self.team.admin, self.dev_cvm_id, enroll.DEV_IMAGE, d
        )

    @property
    def release(self) -> dict[str, Any]:
        return self.measured.release.model_dump(mode="json", exclude_none=True)

    def start(self, launch_dir: Path, state: Path, lines: list[str]) -> None:
        threading.Thread(target=self.origin.serve_forever, daemon=True).start()
        threading.Thread(target=self.tls_origin.serve_forever, daemon=True).start()
        own = launch_dir / "security"
        # The simulator's signing keys, as the simulated host provides them (never launch data).
        self.pki.save(own / "simulated-pki")
        subprocess.run(["chown", "-R", "65534:65534", str(own / "simulated-pki")], check=True)
        data = LaunchData(
            role="security-cvm",
            team=self.team.name,
            cvm_id=self.cvm_id,
            app_compose=self.measured.app_compose.decode(),
            console_url=self.server.url,
            console_ca=self.server_ca,
            enrollment_token=self.token,
        )
        said: list[str] = []
        Agent(
            source=Given(data.as_metadata()),
            extender=LogOnly(),  # the proxy's simulator replays the written event log
            starter=ComposeRunnerStart(self.archives, state, allow_runc=True, say=said.append),
            reporter=None,
            launch_dir=launch_dir,
            say=said.append,
            etc_dir=self.d,
            spool_dir=SPOOL,
        ).run()
        print("\n".join(said))
        assert any("security-cvm" in line and "started" in line for line in said)
        for _ in range(90):
            log = self.log()
            if "umbra tunnel endpoint listening" in log or "Exited" in self._status():
                break
            time.sleep(1)
        log = self.log()
        assert "umbra tunnel endpoint listening" in log, f"the Security CVM did not start:\n{log}"
        # It enrolled with the token (attested against the measured release) and pulled the
        # signed bundle with the credential it got.
        assert "umbra proxy serve: enrolled" in log
        assert "SIMULATED TEE" in log
        with self.server.client() as anonymous:  # the token is spent: single use
            again = anonymous.post("/api/v1/enroll/challenge", json={"token": self.token})
        assert again.status_code == 403 and "reused_token" in again.text
        inspect = json.loads(_docker("inspect", "umbra-security_proxy_1").stdout)[0]
        assert (
            inspect["Config"]["User"] == "65534:65534" and inspect["HostConfig"]["ReadonlyRootfs"]
        )
        assert inspect["HostConfig"]["PortBindings"] == {
            f"{self.tunnel_port}/tcp": [{"HostIp": "", "HostPort": str(self.tunnel_port)}]
        }

    def _status(self) -> str:
        return _docker("ps", "-a", "--filter", "name=umbra-security_proxy_1", "--format",
                       "{{.Status}}", check=False).stdout  # fmt: skip

    def log(self) -> str:
        done = _docker("logs", "umbra-security_proxy_1", check=False)
        return done.stdout + done.stderr

    def traffic(self, match: Any) -> list[dict[str, Any]]:
        for _ in range(40):  # shipped about every second
            page = self.team.admin.get(
                f"/api/v1/teams/{self.team.name}/traffic",
                params={"cvm_id": self.dev_cvm_id, "limit": 100},
            ).json()
            records = [r for r in page["records"] if match(r)]
            if records:
                return records
            time.sleep(0.5)
        return []

    def interception_ca(self) -> bytes:
        """The proxy's interception CA certificate, from its `mitm-ca` state volume."""
        volume = "umbra-security_mitm-ca"
        data = Path(_docker("volume", "inspect", "-f", "{{.Mountpoint}}", volume).stdout.strip())
        return (data / "mitmproxy-ca-cert.pem").read_bytes()

    def check_secrets_kept(self) -> None:
        """Neither the one-time token nor the Dev CVM's credential appears in the proxy's log."""
        log = self.log()
        assert self.token not in log and self.dev_credential not in log

    def stop(self, runner: ComposeRunner) -> None:
        if self.stopped:
            return
        self.stopped = True
        print("security cvm log tail:\n" + "\n".join(self.log().splitlines()[-15:]))
        try:
            runner.down("umbra-security")
        finally:
            for server in (self.origin, self.tls_origin):
                server.shutdown()
                server.server_close()
            self.team.close()


def _check_https_trusts_the_attested_ca(sec: SecurityCvm) -> None:
    """The sandbox's init installed the CA the forwarder fetched inside aTLS (exactly the
    Security CVM's interception CA), and the tools verify HTTPS with it and no CA option."""
    from cryptography import x509

    fetched = _docker("exec", "umbra-dev_sandbox_1", "cat",
                      "/run/umbra/security-ca/security-cvm-ca.pem").stdout  # fmt: skip
    proxy_ca = sec.interception_ca()
    assert [
        c.fingerprint(_sha256()) for c in x509.load_pem_x509_certificates(fetched.encode())
    ] == [x509.load_pem_x509_certificate(proxy_ca).fingerprint(_sha256())]
    init = _docker("logs", "umbra-dev_sandbox_1", check=False)
    assert "trusting 1 Security CVM CA certificate(s)" in init.stdout + init.stderr
    tls = f"https://origin.test:{sec.tls_port}"
    assert _sh(f"curl -sS -m 30 {tls}/allowed").stdout == "u12-origin-ok"
    py = _sh(
        'python3.12 -c "import urllib.request; print(urllib.request.urlopen('
        f"'{tls}/allowed', timeout=30).read().decode())\""
    )
    assert py.stdout.strip() == "u12-origin-ok"
    git = _sh(f"GIT_TERMINAL_PROMPT=0 git ls-remote {tls}/repo.git")
    assert f"{sec.repo_head}\tHEAD" in git.stdout, git.stdout + git.stderr
    # Not trusted because of anything but that CA: without it, curl refuses the proxy's cert.
    bare = _sh(f"curl -sS -m 30 --cacert /dev/null {tls}/allowed", check=False)
    assert bare.returncode != 0


def _sha256() -> Any:
    from cryptography.hazmat.primitives import hashes

    return hashes.SHA256()


def _tls_origin(d: Path) -> ThreadingHTTPServer:
    """An HTTPS origin with its own CA (the proxy's `--upstream-ca`) on the host,
    serving /allowed and a bare git repository over git's dumb HTTP protocol."""
    d.mkdir()
    ca = OriginCA(d)
    cert, key = ca.issue(["origin.test"])
    work, repo = d / "work", d / "www" / "repo.git"
    git = ["git", "-c", "user.name=umbra", "-c", "user.email=tests@umbra.invalid"]
    subprocess.run([*git, "init", "-q", str(work)], check=True)
    subprocess.run(
        [*git, "-C", str(work), "commit", "-q", "--allow-empty", "-m", "u12"], check=True
    )
    subprocess.run([*git, "clone", "-q", "--bare", str(work), str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "update-server-info"], check=True)
    www = d / "www"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return None

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/allowed":
                body = b"u12-origin-ok"
            else:
                f = www / path.lstrip("/")
                if ".." in path or not path.startswith("/repo.git/") or not f.is_file():
                    self.send_error(404)
                    return
                body = f.read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    # On all addresses: the proxy container reaches the host through its bridge gateway.
    server = ThreadingHTTPServer(("0.0.0.0", 0), Handler)  # noqa: S104
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    return server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _origin(www: Path, paths: list[str]) -> ThreadingHTTPServer:
    """The origin: /allowed, and a flat apt repository at /debian with one package."""
    pkg = www / "build/u12-hello"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "usr/share/u12-hello").mkdir(parents=True)
    (pkg / "usr/share/u12-hello/hello").write_text("u12-hello-installed\n")
    (pkg / "DEBIAN/control").write_text(
        "Package: u12-hello\nVersion: 1.0\nArchitecture: all\nMaintainer: umbra tests "
        "<tests@umbra.invalid>\nDescription: a package the sandbox installs through the proxy\n"
    )
    repo = www / "debian"
    repo.mkdir(parents=True)
    deb = repo / "u12-hello_1.0_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(pkg), str(deb)],
                   check=True, capture_output=True)  # fmt: skip
    blob = deb.read_bytes()
    control = (pkg / "DEBIAN/control").read_text()
    (repo / "Packages").write_text(
        control + f"Filename: ./{deb.name}\nSize: {len(blob)}\n"
        f"SHA256: {hashlib.sha256(blob).hexdigest()}\n\n"
    )
    (repo / "Release").write_text("Origin: umbra-tests\nLabel: u12\nSuite: ./\n")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return None

        def do_GET(self) -> None:
            paths.append(self.path)
            if self.path == "/allowed":
                body = b"u12-origin-ok"
            else:
                f = www / self.path.lstrip("/")
                if not self.path.startswith("/debian/") or not f.is_file():
                    self.send_error(404)
                    return
                body = f.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return ThreadingHTTPServer(("0.0.0.0", 0), Handler)  # noqa: S104 -- shown unreachable


@pytest.mark.parametrize("role", ["dev", "security"])
def test_both_rendered_files_lower_to_what_docker_compose_1_29_accepts(
    role: str, tmp_path: Path
) -> None:
    if shutil.which("docker-compose") is None:
        pytest.skip("needs docker-compose (scripts/system-deps installs Debian's 1.29.2)")
    d = dev_definition() if role == "dev" else security_definition()
    text = measure(d).compose.text
    pins = {ref.rpartition("@")[2] for ref in d.compose.images.model_dump().values()}
    images = {pin: "sha256:" + hashlib.sha256(pin.encode()).hexdigest() for pin in pins}
    low = lower(text, config_dir=tmp_path / "configs", images=images, runtimes={"runc"},
                allow_runc=True)  # fmt: skip
    (tmp_path / "lowered.yaml").write_text(low.text)
    done = subprocess.run(
        ["docker-compose", "-p", low.project, "-f", str(tmp_path / "lowered.yaml"), "config"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = yaml.safe_load(done.stdout)
    for svc in doc["services"].values():
        assert svc["image"] in images.values()  # every pin resolved to a local image id
    if role == "dev":
        assert low.project == "umbra-dev" and set(low.configs) == {"forwarder"}
        fwd = doc["services"]["forwarder"]["volumes"]
        assert any(str(v).endswith(":/etc/umbra/forwarder.json:ro") for v in fwd), fwd
        assert doc["services"]["sandbox"]["runtime"] == "runc"
        assert low.notes == ("services.sandbox: runtime runc, because sysbox-runc is absent "
                             "on this engine",)  # fmt: skip
        # Without the development opt-in a missing sysbox is refused, not silently replaced.
        with pytest.raises(ComposeRunError, match="sysbox-runc is not installed"):
            lower(text, config_dir=tmp_path, images=images, runtimes={"runc"})
        # The forwarder quotes (its enrollment) through configfs-tsm: kept on a TDX guest,
        # dropped and said so on a development engine, refused elsewhere.
        tsm = "/sys/kernel/config/tsm/report:/sys/kernel/config/tsm/report"
        assert f"{tsm}:rw" in fwd and "forwarder-state" in doc["volumes"]
        dev_low = lower(text, config_dir=tmp_path, images=images, runtimes={"runc"},
                        allow_runc=True, tsm_present=False)  # fmt: skip
        assert tsm not in yaml.safe_load(dev_low.text)["services"]["forwarder"]["volumes"]
        assert dev_low.notes[-1] == ("services.forwarder: no /sys/kernel/config/tsm/report here, "
                                     "the mount is dropped (no quotes)")  # fmt: skip
        with pytest.raises(ComposeRunError, match="not a TDX guest"):
            lower(text, config_dir=tmp_path, images=images, runtimes={"runc", "sysbox-runc"},
                  tsm_present=False)  # fmt: skip
    # A pin no loaded archive has is refused: nothing is pulled.
    with pytest.raises(ComposeRunError, match="is not loaded here"):
        lower(text, config_dir=tmp_path, images={}, runtimes={"runc", "sysbox-runc"})
