"""The rendered Dev CVM compose file, run for real: the launch agent (simulated TEE) measures it and
starts it with the CVM's own runner (Debian's docker-compose 1.29.2 via
umbra.images.compose_runner) on Debian's docker.io, with the images built by this session and
loaded from their archives (no registry). Runtime: runc, because sysbox is absent here (said in
the output). From inside the sandbox container: no route out, no host service reachable (the
bridge gateway included, TCP and UDP), DNS dead; the agents start; HTTPS from the sandbox
verifies with no CA option, against the interception CA the forwarder fetched over aTLS.

The compose file mounts absolute launch paths (/run/umbra/launch/...), so the test owns that
directory for its duration and refuses to run if something else already does.
"""

from __future__ import annotations

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

from umbra.attest.eventlog import load_event_log, replay
from umbra.attest.simpccs import SimulatedPccs
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.components.launch_data import LaunchData
from umbra.images import host_firewall, image_store
from umbra.images.build import BuildResult
from umbra.images.compose_runner import ComposeRunError, ComposeRunner, lower
from umbra.images.launch_agent import Agent, ComposeRunnerStart, LogOnly, SimulatedRtmr
from umbra.images.measure import (
    boot_events,
    boot_events_of,
    expected_rtmr3,
    instance_events,
    measure,
)
from umbra.proxy.identity import hash_credential

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
    for name in ("forwarder",):
        os.link(out / images[name]["archive"], archives / images[name]["archive"])
    os.link(sandbox.archive, archives / sandbox.archive.name)
    refs = {
        "sandbox": sandbox.ref,
        "forwarder": f"umbra/forwarder@{images['forwarder']['manifest_digest']}",
    }
    pki = SimulatedPki.generate()
    sec = SecurityStandIn(tmp_path / "sec", pki, images["proxy"]["config_digest"])
    _docker("load", "-i", str(out / images["proxy"]["archive"]))
    # The host as containers see it on Docker's default bridge: where the stand-ins listen.
    host_ip = _docker(
        "network", "inspect", "bridge", "-f", "{{(index .IPAM.Config 0).Gateway}}"
    ).stdout.strip()
    octet = 100 + os.getpid() % 100
    lines: list[str] = []
    state = tmp_path / "compose"
    gw = f"10.232.{octet}.1"
    tcp, udp, got = host_services
    runner = ComposeRunner(state, {})
    host_firewall.apply()  # on the CVM its unit runs before docker.service
    try:
        with SimulatedPccs(pki, int(time.time()) - 60, host="0.0.0.0") as pccs:  # noqa: S104
            sec.start()
            definition = dev_definition(
                images=refs,
                allow_simulated=True,
                security_cvm={"host": host_ip, "port": sec.tunnel_port},
                pccs_urls=[f"http://{host_ip}:{pccs.url.rsplit(':', 1)[1]}"],
                tunnels=[],
                sandbox_subnet=f"10.232.{octet}.0/24",
                uplink_subnet=f"10.234.{octet}.0/29",
            )
            m = measure(definition)
            data = LaunchData(
                role="dev-cvm",
                team="acme",
                cvm_id="u12-dev",
                app_compose=m.app_compose.decode(),
                ssh_authorized_keys=(ALICE,),
            )
            # Not launch data (no long-lived credential there): the forwarder enrolls at first
            # start and keeps the credential in its state volume (tests/up/test_enrollment.py
            # runs that enrollment against the real Console). This engine has no configfs-tsm to
            # quote with, so the test puts the credential where the enrollment would.
            _seed_forwarder_state(TUNNEL_TOKEN)
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
            )
            agent.run()
            _check_the_running_dev_cvm(m, tdx, launch_dir, lines, sandbox, octet)
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
            records = sec.traffic()
            print("traffic records:", [(r.get("host"), r.get("path")) for r in records])
            assert any(
                "origin.test" in json.dumps(r) and "/allowed" in json.dumps(r) for r in records
            )
            assert any(r.get("cvm_id") == "u12-dev" for r in records)
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
            assert sec.log().count("umbra tunnel endpoint listening") == 1
            assert pccs.requests, "the forwarder fetched no collateral: it did not verify"
    finally:
        try:
            runner.down("umbra-dev")
            _docker("volume", "rm", "-f", "umbra-dev_forwarder-state", check=False)
        finally:
            sec.stop()
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
    m: Any, tdx: SimulatedTdx, launch_dir: Path, lines: list[str], sandbox: Any, octet: int
) -> None:
    print("\n".join(lines))
    # Stated plainly: not the production runtime.
    assert "umbra-compose: services.sandbox: runtime runc, because sysbox-runc is absent" in (
        "\n".join(lines)
    )
    log = load_event_log((launch_dir / "event-log.json").read_bytes())
    boot = boot_events_of("dev-cvm", log)  # this boot's id and host key, shape-checked
    assert boot is not None
    events = instance_events("dev-cvm", "u12-dev", [ALICE]) + boot_events("dev-cvm", *boot)
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


TUNNEL_TOKEN = "u12-tunnel-credential-0123456789"


class SecurityStandIn:
    """The Security CVM side: its launch agent's event log (simulated TEE) and the proxy image
    running `umbra proxy serve` with that log (host network), a local policy, an origin and an
    apt repository on the host. Not the rendered Security compose: that one needs a Console."""

    def __init__(self, d: Path, pki: SimulatedPki, image: str) -> None:
        self.d, self.image = d, image
        self.name = f"u12-sec-{os.getpid()}"
        self.tunnel_port, self.proxy_port = _free_port(), _free_port()
        d.mkdir()
        pki.save(d / "pki")
        m = measure(security_definition())
        data = LaunchData(
            role="security-cvm", team="acme", cvm_id="u12-sec", app_compose=m.app_compose.decode()
        )
        Agent(Given(data.as_metadata()), LogOnly(), _NoStart(), None, d / "launch",
              lambda _line: None, etc_dir=d).run()  # fmt: skip
        self.origin_paths: list[str] = []
        self.origin = _origin(d / "www", self.origin_paths)
        self.origin_port = self.origin.server_address[1]
        (d / "policies").mkdir()
        self.tls_origin = _tls_origin(d / "tls")
        self.repo_head = subprocess.run(
            ["git", "-C", str(d / "tls/www/repo.git"), "rev-parse", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        self.tls_port = self.tls_origin.server_address[1]
        (d / "policies/testing.yaml").write_text(
            "apiVersion: umbra/v1\nkind: Profile\nname: testing\negress:\n"
            f"  - id: origin\n    allow: {{hosts: [origin.test], schemes: [http], "
            f"ports: [{self.origin_port}]}}\n"
            f"  - id: origin-tls\n    allow: {{hosts: [origin.test], schemes: [https], "
            f"ports: [{self.tls_port}]}}\n"
        )
        (d / "identities.json").write_text(json.dumps({"cvms": [{
            "cvm_id": "u12-dev", "owner": "dev", "team": "acme", "profiles": ["testing"],
            "credential_sha256": hash_credential(TUNNEL_TOKEN)}]}))  # fmt: skip
        (d / "resolver.json").write_text(
            json.dumps({"origin.test": ["127.0.0.1"], "denied.test": ["127.0.0.1"]})
        )
        for sub in ("spool", "mitm-ca"):
            (d / sub).mkdir(mode=0o777)
            (d / sub).chmod(0o777)
        subprocess.run(["chmod", "-R", "a+rX", str(d)], check=True)

    def start(self) -> None:
        threading.Thread(target=self.origin.serve_forever, daemon=True).start()
        threading.Thread(target=self.tls_origin.serve_forever, daemon=True).start()
        _docker(
            "run", "-d", "--name", self.name, "--network", "host", "--runtime", "runc",
            "-v", f"{self.d}:/sec", self.image,
            "umbra", "proxy", "serve", "--workers", "1",
            "--listen", f"127.0.0.1:{self.proxy_port}",
            "--tunnel-listen", f"0.0.0.0:{self.tunnel_port}",
            "--quote-source", "simulated", "--simulated-pki", "/sec/pki",
            "--event-log", "/sec/launch/security/event-log.json",
            "--policy-dir", "/sec/policies", "--identities", "/sec/identities.json",
            "--traffic-log", "/sec/spool", "--confdir", "/sec/mitm-ca",
            "--upstream-ca", "/sec/tls/origin-ca.pem",
            "--test-allow-upstream", "127.0.0.1/32", "--test-resolver", "/sec/resolver.json",
        )  # fmt: skip
        for _ in range(60):
            if "umbra tunnel endpoint listening" in self.log():
                return
            time.sleep(1)
        raise AssertionError(f"the Security CVM stand-in did not start:\n{self.log()}")

    def log(self) -> str:
        done = _docker("logs", self.name, check=False)
        return done.stdout + done.stderr

    def traffic(self) -> list[dict[str, Any]]:
        for _ in range(20):  # the spool is appended after the response
            records = [
                json.loads(line)
                for p in sorted((self.d / "spool").glob("*.jsonl"))
                for line in p.read_text().splitlines()
                if line.strip()
            ]
            if records:
                return records
            time.sleep(0.5)
        return []

    def stop(self) -> None:
        print("security stand-in log tail:\n" + "\n".join(self.log().splitlines()[-15:]))
        _docker("rm", "-f", self.name, check=False)
        for server in (self.origin, self.tls_origin):
            server.shutdown()
            server.server_close()


def _check_https_trusts_the_attested_ca(sec: SecurityStandIn) -> None:
    """The sandbox's init installed the CA the forwarder fetched inside aTLS (exactly the
    Security CVM's interception CA), and the tools verify HTTPS with it and no CA option."""
    from cryptography import x509

    fetched = _docker("exec", "umbra-dev_sandbox_1", "cat",
                      "/run/umbra/security-ca/security-cvm-ca.pem").stdout  # fmt: skip
    proxy_ca = (sec.d / "mitm-ca" / "mitmproxy-ca-cert.pem").read_bytes()
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
    """An HTTPS origin with its own CA (the proxy's `--upstream-ca`) on the host's loopback,
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

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    return server


class _NoStart:
    def start(self, compose: Path) -> None:
        return None


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
