"""The Security CVM's rendered compose file run for real, and a Dev CVM's dev host against it.

The Security CVM: the launch agent (simulated TEE) measures its compose and starts it with the
CVM's own runner (Debian's docker-compose 1.29.2 via umbra.images.compose_runner) on Debian's
docker.io, with the `runtime` image built by this session and loaded from its archive (no
registry). It is a `tee: simulated` release (its proxy quotes with the simulator, its test
options reach the host's origin) against the real Console (SQLite, over TLS with its own CA from
launch data): it enrolls with the one-time token the launch agent wrote, pulls the signed bundle
and the Dev CVM's attachment, and ships its traffic log there.

The Dev CVM: the same launch agent, given a `dev_cvm_host` app-compose, starts the dev host
(`umbra sandbox host up`: the forwarder and the runc sandbox of the cached image,
sandbox/dev_host.py) exactly as on a CVM, at a free subnet index of this machine. Its forwarder
attests the Security CVM (the measured Security release, compose hash included) before relaying,
fetches its interception CA, and the sandbox's init installs it. From inside the sandbox: no
route out, every name is the forwarder, HTTP and HTTPS only through forwarder -> proxy -> origin
(recorded at the Console against the Dev CVM), `sudo apt-get install` through the proxy, the
agents start.

The launch agent writes absolute paths (/run/umbra/launch/..., the dev host's directory on the
data disk, the forwarder's credential), so the test owns them for its duration and refuses to
run if something else already does.
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
import sys
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
from umbra.images import image_store
from umbra.images.compose_runner import ComposeRunError, ComposeRunner, lower
from umbra.images.launch_agent import (
    SPOOL,
    Agent,
    ComposeRunnerStart,
    DevHostStart,
    LogOnly,
)
from umbra.images.measure import (
    boot_events,
    boot_events_of,
    expected_rtmr3,
    instance_events,
    measure,
    release_events,
)
from umbra.policy.bundle import generate_key, payload_document, sign_bundle
from umbra.policy.loader import load_policy_dir
from umbra.sandbox import image, local_cvm
from umbra.sandbox.dev_definition import (
    DEV_HOST_ROOT,
    FORWARDER_STATE_DIR,
    RUNNER,
    host_document,
    plan_for,
)
from umbra.sandbox.render import CA_NAME, canonical_json

from ..proxy.harness import TestCA as OriginCA
from ..sandbox.fixtures import dev_definition, security_definition
from .conftest import docker_up
from .simulated_rtmr import SimulatedRtmr

pytestmark = pytest.mark.timeout(1500)

LAUNCH = Path("/run/umbra/launch")
DEV_ROOT = Path(DEV_HOST_ROOT)
FWD_STATE = Path(FORWARDER_STATE_DIR)
ALICE = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice"


@dataclass(frozen=True)
class Given:
    meta: dict[str, str]

    def fetch(self) -> dict[str, str]:
        return self.meta

    def instance_name(self) -> str:
        raise AssertionError("launch data without umbra-instance-name asks no name")


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
    owned = (LAUNCH, SPOOL, DEV_ROOT, FWD_STATE)
    for path in owned:
        if path.exists():
            pytest.fail(f"{path} exists: another CVM (or test) owns it on this machine")
    # The agent and the dev host create these with their parents: remove the topmost created.
    created = set()
    for path in owned:
        while not path.parent.exists():
            path = path.parent
        created.add(path)
    try:
        yield LAUNCH
    finally:
        for path in sorted(created, key=lambda p: len(p.parts), reverse=True):
            shutil.rmtree(path, ignore_errors=True)


def _free_index() -> int:
    """A subnet index no local CVM on this machine uses (a CVM's dev host takes 1, alone)."""
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True)
    used = {int(w.split(".")[2]) for w in shown.stdout.split() if w.startswith("10.232.")}
    return next(i for i in range(240, 100, -1) if i not in used)


def _dev_host_down(definition: Path) -> None:
    umbra = str(Path(sys.executable).parent / "umbra")
    subprocess.run(
        [umbra, "sandbox", "host", "down", "--definition", str(definition), "--root",
         str(DEV_ROOT), "--image-dir", str(image.cache_root())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_dev_host_reaches_the_security_cvm_compose_through_the_attested_forwarder(
    runtime_builds: tuple[Path, dict[str, dict[str, str]], dict[str, dict[str, str]]],
    launch_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docker_up()
    for tool in ("runc", "nft", "nsenter", "mmdebstrap", "npm"):
        if shutil.which(tool) is None:
            pytest.skip(f"LOUD SKIP: missing {tool}: scripts/system-deps installs it")
    image.ensure_image()  # the sandbox image, cached per machine (an OS image ships a copy)
    out, images, _ = runtime_builds
    pki = enroll.pki()  # the test Console's enrollment verifiers trust this simulated root
    # The host as containers see it on Docker's default bridge: where the Console and the origin
    # listen (the Security CVM reaches them from its own bridge through the host), and where the
    # dev host's forwarder finds the Security CVM's published tunnel port.
    host_ip = bridge_gateway()
    index = _free_index()
    lines: list[str] = []
    state = tmp_path / "compose"
    runner = ComposeRunner(state, {})
    sec: SecurityCvm | None = None
    try:
        with (
            SimulatedPccs(pki, int(time.time()) - 60, host="0.0.0.0") as pccs,  # noqa: S104
            _console(tmp_path / "console", host_ip, monkeypatch) as (server, ca, issuer),
            contextlib.ExitStack() as down,
        ):
            sec = SecurityCvm(tmp_path / "sec", pki, server, ca, issuer, host_ip, out, images)
            # Both go down (the Dev CVM first) while the Console still answers the proxy.
            down.callback(sec.stop, runner)
            down.callback(_dev_host_down, launch_dir / "dev-cvm.json")
            sec.start(launch_dir, state, lines)
            definition = dev_definition(
                allow_simulated=True,
                security_cvm={"host": host_ip, "port": sec.tunnel_port},
                security_cvm_release=sec.release,
                pccs_urls=[f"http://{host_ip}:{pccs.url.rsplit(':', 1)[1]}"],
                tunnels=[],
            )
            # As `umbra image measure` renders it, at this machine's free index (a CVM: 1).
            host_text = canonical_json(host_document(definition.host, index))
            app = canonical_json({"dev_cvm_host": host_text, "manifest_version": 2,
                                  "name": definition.name, "runner": RUNNER})  # fmt: skip
            data = LaunchData(
                role="dev-cvm",
                team=sec.team.name,
                cvm_id=sec.dev_cvm_id,
                app_compose=app,
                ssh_authorized_keys=(ALICE,),
            )
            # Not launch data (no long-lived credential there): the forwarder enrolls at first
            # start. Nothing here can quote with configfs-tsm, so the test enrolled the Dev CVM
            # at the Console as its simulated TD (same routes, one-time token) and puts the
            # credential where the enrollment would.
            FWD_STATE.mkdir(parents=True, mode=0o700)
            (FWD_STATE / "tunnel-credential").write_text(sec.dev_credential + "\n")
            (FWD_STATE / "tunnel-credential").chmod(0o600)
            (launch_dir / "forwarder").mkdir(parents=True)
            (launch_dir / "forwarder" / "simulated-root.der").write_bytes(pki.root_der)
            tdx = SimulatedTdx(pki, image="umbra-dev-cvm")
            Agent(
                source=Given(data.as_metadata()),
                extender=SimulatedRtmr(tdx),
                starter=ComposeRunnerStart(tmp_path / "none", state, say=lines.append),
                reporter=None,
                launch_dir=launch_dir,
                say=lines.append,
                dev_host=DevHostStart(DEV_ROOT, image.cache_root()),
            ).run()
            plan = plan_for(sec.dev_cvm_id, index, DEV_ROOT)
            _check_the_running_dev_cvm(app, tdx, launch_dir, lines, sec.dev_cvm_id, plan)
            sh = _Sandbox(plan)
            # No route out: the host's origin directly is unreachable; every name is the
            # forwarder's; through the proxy, the origin by address is denied by policy.
            url = f"http://{host_ip}:{sec.origin_port}/allowed"
            assert sh(f"curl -sS -m 5 --noproxy '*' {url}", check=False).returncode != 0
            names = sh("getent hosts origin.test deb.debian.org").stdout.split()
            assert names[0::2] == [plan.forwarder_addr, plan.forwarder_addr], names
            assert sh(f"curl -sS -m 30 {url}").stdout.startswith("umbra: denied")
            # HTTP only through forwarder -> (attested) Security CVM proxy -> origin.
            allowed = sh(f"curl -sS -m 30 http://origin.test:{sec.origin_port}/allowed")
            assert allowed.stdout == "u12-origin-ok"
            denied = sh(
                f"curl -sS -m 30 -o /dev/null -w '%{{http_code}}' "
                f"http://denied.test:{sec.origin_port}/x",
                check=False,
            )
            print("denied:", denied.stdout, denied.stderr)
            assert denied.stdout.startswith("4") and "/x" not in sec.origin_paths
            assert "/allowed" in sec.origin_paths
            _check_https_trusts_the_attested_ca(sec, sh, plan)
            # The proxy's records reach the Console (shipped with its enrolled credential),
            # attributed to the Dev CVM, its owner and team from the Console's attachments.
            records = sec.traffic(lambda r: r.get("path") == "/allowed")
            print("traffic records:", [(r.get("host"), r.get("path")) for r in records])
            assert records and all(r["cvm_id"] == sec.dev_cvm_id for r in records)
            assert records[0]["owner"] == sec.team.dev_subject
            assert records[0]["team"] == sec.team.name
            # sudo apt-get install through the proxy, from the stand-in apt repo.
            repo = f"http://origin.test:{sec.origin_port}/debian"
            apt = sh(
                f"echo 'deb [trusted=yes] {repo} ./' | sudo tee /tmp/u12.list >/dev/null && "
                "opts='-o Dir::Etc::sourcelist=/tmp/u12.list -o Dir::Etc::sourceparts=-' && "
                "sudo apt-get $opts update -q && sudo apt-get $opts install -y -q u12-hello && "
                "cat /usr/share/u12-hello/hello"
            )
            assert apt.stdout.strip().endswith("u12-hello-installed"), apt.stdout + apt.stderr
            agents = sh("claude --version && codex --version")
            print(agents.stdout)
            assert "Claude Code" in agents.stdout and "codex" in agents.stdout.lower()
            # The forwarder verified the Security CVM's (simulated) quote before relaying.
            assert "umbra tunnel endpoint listening" in sec.log()
            _wait_running("umbra-security_proxy_1")  # never restarted
            assert pccs.requests, "the forwarder fetched no collateral: it did not verify"
            sec.check_secrets_kept()
    finally:
        try:
            _dev_host_down(launch_dir / "dev-cvm.json")
        finally:
            if sec is not None:
                sec.stop(runner)
            _docker("rmi", "-f", images["proxy"]["config_digest"], check=False)


def _check_the_running_dev_cvm(
    app: str,
    tdx: SimulatedTdx,
    launch_dir: Path,
    lines: list[str],
    cvm_id: str,
    plan: local_cvm.LocalCvmPlan,
) -> None:
    print("\n".join(lines))
    assert any("dev-cvm" in line and "started" in line for line in lines), lines
    log = load_event_log((launch_dir / "event-log.json").read_bytes())
    boot = boot_events_of("dev-cvm", log)  # this boot's id and host key, shape-checked
    assert boot is not None
    events = instance_events("dev-cvm", cvm_id, [ALICE]) + boot_events("dev-cvm", *boot)
    release = release_events(hashlib.sha256(app.encode()).digest())
    want = expected_rtmr3(release + events).hex()
    assert replay(log)[3].hex() == want == tdx.rtmrs()[3].hex()
    # The measured document, exactly (the docker-compose.yaml beside it is the Security CVM's:
    # both agents share this machine's launch directory).
    doc = json.loads(app)
    assert (launch_dir / "dev-cvm.json").read_text() == doc["dev_cvm_host"]
    for role in ("sandbox", "forwarder", "supervisor"):
        assert local_cvm.running_pid(plan, role) is not None, role
    # No container of the Dev CVM's: the sandbox is runc's, the forwarder a host process.
    ps = _docker("ps", "--filter", "label=com.docker.compose.project=umbra-dev",
                 "--format", "{{.Names}}").stdout  # fmt: skip
    assert ps.strip() == ""


class _Sandbox:
    """A command in the dev host's sandbox as `dev`, in a login shell's environment."""

    def __init__(self, plan: local_cvm.LocalCvmPlan) -> None:
        self.plan = plan

    def __call__(self, cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = local_cvm.run_in_sandbox(self.plan, ["bash", "-c", cmd], "dev", timeout=300)
        if check and done.returncode != 0:
            log = (self.plan.dir / "forwarder.log").read_text(errors="replace")[-1500:]
            raise AssertionError(
                f"in the sandbox: {cmd}: {done.stdout}{done.stderr}\nforwarder: {log}"
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
            starter=ComposeRunnerStart(self.archives, state, say=said.append),
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


def _check_https_trusts_the_attested_ca(
    sec: SecurityCvm, sh: _Sandbox, plan: local_cvm.LocalCvmPlan
) -> None:
    """The sandbox's init installed the CA the forwarder fetched inside aTLS (exactly the
    Security CVM's interception CA), and the tools verify HTTPS with it and no CA option."""
    from cryptography import x509

    fetched = DEV_ROOT / "sandbox-ca" / CA_NAME
    installed = plan.rootfs / local_cvm.CA_INSTALLED.lstrip("/")
    end = time.monotonic() + 120  # the forwarder's first fetch, then the init's 5 s watcher
    while not installed.exists() and time.monotonic() < end:
        time.sleep(0.5)
    assert installed.exists(), (plan.dir / "forwarder.log").read_text(errors="replace")[-1500:]
    proxy_ca = sec.interception_ca()
    assert [
        c.fingerprint(_sha256()) for c in x509.load_pem_x509_certificates(fetched.read_bytes())
    ] == [x509.load_pem_x509_certificate(proxy_ca).fingerprint(_sha256())]
    tls = f"https://origin.test:{sec.tls_port}"
    assert sh(f"curl -sS -m 30 {tls}/allowed").stdout == "u12-origin-ok"
    py = sh(
        'python3 -c "import urllib.request; print(urllib.request.urlopen('
        f"'{tls}/allowed', timeout=30).read().decode())\""
    )
    assert py.stdout.strip() == "u12-origin-ok"
    git = sh(f"GIT_TERMINAL_PROMPT=0 git ls-remote {tls}/repo.git")
    assert f"{sec.repo_head}\tHEAD" in git.stdout, git.stdout + git.stderr
    # Not trusted because of anything but that CA: without it, curl refuses the proxy's cert.
    bare = sh(f"curl -sS -m 30 --cacert /dev/null {tls}/allowed", check=False)
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


def test_the_security_file_lowers_to_what_docker_compose_1_29_accepts(tmp_path: Path) -> None:
    if shutil.which("docker-compose") is None:
        pytest.skip("needs docker-compose (scripts/system-deps installs Debian's 1.29.2)")
    d = security_definition()
    text = measure(d).compose.text
    pins = {ref.rpartition("@")[2] for ref in d.compose.images.model_dump().values()}
    images = {pin: "sha256:" + hashlib.sha256(pin.encode()).hexdigest() for pin in pins}
    low = lower(text, config_dir=tmp_path / "configs", images=images, runtimes={"runc"})
    (tmp_path / "lowered.yaml").write_text(low.text)
    done = subprocess.run(
        ["docker-compose", "-p", low.project, "-f", str(tmp_path / "lowered.yaml"), "config"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = yaml.safe_load(done.stdout)
    for svc in doc["services"].values():
        assert svc["image"] in images.values()  # every pin resolved to a local image id
    assert low.project == "umbra-security" and low.notes == ()
    # The proxy quotes (its enrollment, its sessions) through configfs-tsm: kept on a TDX
    # guest, dropped and said so only with the development opt-in, refused elsewhere.
    tsm = "/sys/kernel/config/tsm/report:/sys/kernel/config/tsm/report"
    assert any(str(v).startswith(tsm) for v in doc["services"]["proxy"]["volumes"])
    dev_low = lower(text, config_dir=tmp_path, images=images, runtimes={"runc"},
                    allow_missing_tsm=True, tsm_present=False)  # fmt: skip
    assert not any(
        str(v).startswith(tsm) for v in yaml.safe_load(dev_low.text)["services"]["proxy"]["volumes"]
    )
    assert dev_low.notes == ("services.proxy: no /sys/kernel/config/tsm/report here, "
                             "the mount is dropped (no quotes)",)  # fmt: skip
    with pytest.raises(ComposeRunError, match="not a TDX guest"):
        lower(text, config_dir=tmp_path, images=images, runtimes={"runc"}, tsm_present=False)
    # A runtime the engine lacks is refused (the validator allows none on this file anyway).
    with_runtime = text.replace("    restart: ", "    runtime: sysbox-runc\n    restart: ", 1)
    with pytest.raises(ComposeRunError, match="sysbox-runc is not installed in the engine"):
        lower(with_runtime, config_dir=tmp_path, images=images, runtimes={"runc"})
    # A pin no loaded archive has is refused: nothing is pulled.
    with pytest.raises(ComposeRunError, match="is not loaded here"):
        lower(text, config_dir=tmp_path, images={}, runtimes={"runc"})
