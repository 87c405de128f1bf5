"""The launch agent against a metadata stand-in (a real HTTP server speaking GCP's metadata and
Azure's IMDS/wire-server protocols) and the simulated TEE: the events it extends replay to exactly
what `umbra image measure` predicts, a verifier accepts the quote, and bad launch data starts
nothing and says why on the serial console."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from umbra.attest.collateral import StaticCollateral
from umbra.attest.eventlog import load_event_log, replay
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verifier
from umbra.cli.app import app
from umbra.components.launch_data import LaunchData
from umbra.images.launch_agent import (
    Agent,
    AzureUserData,
    AzureWireServer,
    GcpGuestAttribute,
    GcpMetadata,
    LaunchError,
    LogOnly,
    Refusal,
)
from umbra.images.measure import boot_events_of, measure
from umbra.sandbox.render import canonical_json

from ..sandbox.fixtures import (
    dev_definition,
    dev_definition_doc,
    security_definition,
    security_definition_doc,
)
from .simulated_rtmr import SimulatedRtmr

ALICE = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice"
runner = CliRunner()


@dataclass
class StandIn:
    """GCP metadata + Azure IMDS + Azure wire server, on loopback."""

    attributes: dict[str, str] = field(default_factory=dict)
    user_data: str = ""
    guest_attributes: dict[str, str] = field(default_factory=dict)
    health: list[str] = field(default_factory=list)
    url: str = ""
    vm_name: str = "umbra-acme-sec"


@pytest.fixture
def standin() -> Iterator[StandIn]:
    state = StandIn()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return None

        def _send(self, code: int, body: str, ctype: str = "text/plain") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.startswith("/computeMetadata/v1/instance/attributes/?recursive=true"):
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._send(403, "missing Metadata-Flavor")
                return self._send(200, json.dumps(state.attributes), "application/json")
            if self.path == "/computeMetadata/v1/instance/name":
                return self._send(200, state.vm_name)
            if self.path.startswith("/metadata/instance?"):
                doc = {"compute": {"name": state.vm_name}}
                return self._send(200, json.dumps(doc), "application/json")
            if self.path.startswith("/metadata/instance/compute/userData"):
                if self.headers.get("Metadata") != "true":
                    return self._send(400, "missing Metadata: true")
                return self._send(200, state.user_data)
            if self.path == "/machine/?comp=goalstate":
                return self._send(
                    200,
                    "<GoalState><Incarnation>7</Incarnation><Container><ContainerId>c-1"
                    "</ContainerId><RoleInstanceList><RoleInstance><InstanceId>i-1</InstanceId>"
                    "</RoleInstance></RoleInstanceList></Container></GoalState>",
                )
            return self._send(404, "no such path")

        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
            state.guest_attributes[self.path.rsplit("/", 1)[1]] = body
            self._send(200, "")

        def do_POST(self) -> None:
            state.health.append(
                self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
            )
            self._send(200, "")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class RecordingStarter:
    started: list[str] = field(default_factory=list)

    def start(self, compose: Path) -> None:
        self.started.append(compose.read_text())


@pytest.fixture(scope="module")
def pki() -> SimulatedPki:
    return SimulatedPki.generate()


def _dev_launch() -> tuple[LaunchData, Any]:
    m = measure(dev_definition())
    data = LaunchData(
        role="dev-cvm",
        team="team-a",
        cvm_id="dev-alice-1",
        app_compose=m.app_compose.decode(),
        ssh_authorized_keys=(ALICE,),
    )
    return data, m


def _predicted(
    tmp_path: Path,
    cvm_id: str,
    keys: list[str],
    definition: dict[str, Any],
    boot: tuple[str, str] | None = None,
) -> str:
    """What `umbra image measure` says RTMR3 must be for this instance (and, on a Dev CVM, for
    this boot's id and host key: the per-boot values a verifier reads from the log)."""
    path = tmp_path / "definition.yaml"
    path.write_text(yaml.safe_dump(definition))
    args = ["image", "measure", str(path), "--cvm-id", cvm_id, "--json"]
    for k in keys:
        args += ["--ssh-key", k]
    if boot is not None:
        args += ["--boot-id", boot[0], "--ssh-host-key", boot[1]]
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    expected: str = json.loads(done.stdout)["instance"]["expected_rtmr3"]
    return expected


def test_dev_cvm_on_gcp_extends_what_measure_predicts_and_verifies(
    standin: StandIn, pki: SimulatedPki, tmp_path: Path
) -> None:
    data, m = _dev_launch()
    standin.attributes = data.gcp_metadata() | {"startup-script": "ignored: not umbra-*"}
    tdx = SimulatedTdx(pki, image="umbra-dev-cvm")
    starter, lines = RecordingStarter(), []
    agent = Agent(
        source=GcpMetadata(standin.url),
        extender=SimulatedRtmr(tdx),
        starter=starter,
        reporter=GcpGuestAttribute(standin.url),
        launch_dir=tmp_path / "launch",
        say=lines.append,
    )
    agent.run()
    log = load_event_log((tmp_path / "launch/event-log.json").read_bytes())
    # The per-boot values cannot be predicted: read them from the log, where their names and
    # positions (last, in order) and their shape are checked, then predict everything else.
    boot = boot_events_of("dev-cvm", log)
    assert boot is not None
    boot_id, host_key = boot
    launch = tmp_path / "launch/ssh"
    assert (launch / "boot-id").read_text() == boot_id + "\n"
    assert (launch / "ssh_host_ed25519_key.pub").read_text() == host_key + "\n"
    predicted = _predicted(tmp_path, "dev-alice-1", [ALICE], dev_definition_doc(), boot)
    assert tdx.rtmrs()[3].hex() == predicted
    # The event log the agent wrote replays to the same value.
    assert replay(log)[3].hex() == predicted
    # Without the per-boot values, measure predicts the value before them and what must follow.
    path = tmp_path / "definition.yaml"
    done = runner.invoke(
        app,
        ["image", "measure", str(path), "--cvm-id", "dev-alice-1", "--ssh-key", ALICE, "--json"],
    )
    inst = json.loads(done.stdout)["instance"]
    assert inst["expected_rtmr3"] is None
    assert inst["per_boot_events"] == ["umbra.boot-id", "umbra.ssh-host-key"]
    assert replay(log[: -len(inst["per_boot_events"])])[3].hex() == inst["rtmr3_before_boot"]
    # The private key is root-only, exactly the key the event binds, and in no other output.
    private = (launch / "ssh_host_ed25519_key").read_bytes()
    from cryptography.hazmat.primitives import serialization

    loaded = serialization.load_ssh_private_key(private, password=None)
    pub = loaded.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    assert pub.decode() == host_key
    secret = private.split(b"\n")[1]
    for f in (tmp_path / "launch").rglob("*"):
        if f.is_file() and f.name != "ssh_host_ed25519_key":
            assert secret not in f.read_bytes(), f
    assert all(secret.decode() not in line for line in lines)
    assert starter.started == [m.compose.text]
    assert (tmp_path / "launch/forwarder/cvm-id").read_text() == "dev-alice-1\n"
    assert (tmp_path / "launch/ssh/authorized_keys").read_text() == ALICE + "\n"
    assert (tmp_path / "launch/ssh/ssh_host_ed25519_key").stat().st_mode & 0o777 == 0o600
    assert standin.guest_attributes == {"ready": data.compose_sha256}
    # And a verifier holding the release + this instance's binding accepts the quote.
    verifier = Verifier(
        MeasurementPolicy(release=m.release, binding=m.binding("dev-alice-1", [ALICE])),
        StaticCollateral(pki.collateral(int(time.time()) - 60)),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    verifier.verify(tdx.quote(b"nonce"), event_log=tdx.event_log())
    assert any("started" in line for line in lines)


CONSOLE_ID = "cvm_5ec0000000000001"


def test_security_cvm_on_azure_user_data_reports_ready(standin: StandIn, tmp_path: Path) -> None:
    # A team stack's replica carries the Console's id for it (`cvm_<hex>`: with an underscore).
    m = measure(security_definition())
    data = LaunchData(
        role="security-cvm", team="team-a", cvm_id=CONSOLE_ID, app_compose=m.app_compose.decode()
    )
    standin.user_data = data.azure_user_data()
    starter = RecordingStarter()
    Agent(
        source=AzureUserData(standin.url),
        extender=LogOnly(),
        starter=starter,
        reporter=AzureWireServer(standin.url),
        launch_dir=tmp_path / "launch",
        say=lambda _line: None,
    ).run()
    log = load_event_log((tmp_path / "launch/security/event-log.json").read_bytes())
    predicted = _predicted(tmp_path, CONSOLE_ID, [], security_definition_doc())
    assert replay(log)[3].hex() == predicted
    assert starter.started == [m.compose.text]
    assert (tmp_path / "launch/security/security-cvm-id").read_text() == CONSOLE_ID + "\n"
    assert len(standin.health) == 1 and "<State>Ready</State>" in standin.health[0]
    assert "<GoalStateIncarnation>7<" in standin.health[0]


def _mutations() -> list[tuple[str, Refusal, Any]]:
    def drop(key: str) -> Any:
        return lambda meta: {k: v for k, v in meta.items() if k != key}

    def put(key: str, value: str) -> Any:
        return lambda meta: meta | {key: value}

    return [
        ("compose hash copy differs", Refusal.MISMATCH, put("umbra-compose-hash", "0" * 64)),
        ("no cvm id", Refusal.MISSING, drop("umbra-cvm-id")),
        ("unknown key", Refusal.UNKNOWN, put("umbra-extra", "x")),
        ("no ssh keys", Refusal.MISSING, drop("umbra-ssh-authorized-keys")),
        ("bad ssh key", Refusal.INVALID, put("umbra-ssh-authorized-keys", "not-a-key\n")),
        ("bad role", Refusal.INVALID, put("umbra-role", "root")),
        ("bad cvm id", Refusal.INVALID, put("umbra-cvm-id", "../../etc")),
        ("events copy differs", Refusal.MISMATCH, put("umbra-rtmr3-events", "{}")),
        (
            "non-canonical app compose",
            Refusal.INVALID,
            lambda meta: meta | {"umbra-app-compose": meta["umbra-app-compose"] + " "},
        ),
        ("nothing at all", Refusal.MISSING, lambda meta: {}),
    ]


@pytest.mark.parametrize(("what", "reason", "mutate"), _mutations(), ids=lambda x: str(x))
def test_bad_launch_data_starts_nothing_and_says_why(
    standin: StandIn, pki: SimulatedPki, tmp_path: Path, what: str, reason: Refusal, mutate: Any
) -> None:
    data, _ = _dev_launch()
    standin.attributes = mutate(data.as_metadata())
    tdx = SimulatedTdx(pki, image="umbra-dev-cvm")
    before = tdx.event_log()
    starter, lines = RecordingStarter(), []
    agent = Agent(
        GcpMetadata(standin.url), SimulatedRtmr(tdx), starter, None, tmp_path / "l", lines.append
    )
    with pytest.raises(LaunchError) as exc:
        agent.run()
    assert exc.value.reason is reason, what
    assert tdx.event_log() == before and starter.started == []
    assert not (tmp_path / "l").exists()
    # Exactly one line: the serial log a cloud shows is read by people, one cause per refusal.
    assert len(lines) == 1 and "REFUSED, nothing started" in lines[0] and str(reason) in lines[0]


def test_unreachable_metadata_starts_nothing(tmp_path: Path) -> None:
    lines: list[str] = []
    agent = Agent(
        GcpMetadata("http://127.0.0.1:9", timeout=2),
        LogOnly(),
        RecordingStarter(),
        None,
        tmp_path / "l",
        lines.append,
    )
    with pytest.raises(LaunchError) as exc:
        agent.run()
    assert exc.value.reason is Refusal.UNREACHABLE and "REFUSED" in lines[-1]


def test_cli_agent_runs_the_compose_command_or_refuses_on_the_console(
    standin: StandIn, tmp_path: Path
) -> None:
    data, _ = _dev_launch()
    standin.attributes = data.gcp_metadata()
    serial = tmp_path / "ttyS0"
    marker = tmp_path / "compose-ran"
    script = tmp_path / "compose"
    script.write_text(f'#!/bin/sh\necho "$@" > {marker}\n')
    script.chmod(0o755)
    base = ["image", "launch-agent", "--cloud", "gcp", "--tee", "simulated", "--no-ingress",
            "--no-idle-stop",
            "--metadata-url", standin.url, "--launch-dir", str(tmp_path / "launch"),
            "--data-disk", "none", "--dev-host-root", str(tmp_path / "dev-host"),
            "--console", str(serial), "--compose", str(script)]  # fmt: skip
    # The simulated TEE's ingress signs with a simulated PKI: say which, or start no ingress.
    usage = runner.invoke(app, [a for a in base if a != "--no-ingress"])
    assert usage.exit_code == 2 and "--simulated-pki" in usage.output
    assert not marker.exists()
    done = runner.invoke(app, base)
    assert done.exit_code == 0, done.output
    # `--compose` (tests) replaces every starter: it is handed the measured host definition.
    compose = tmp_path / "launch/dev-cvm.json"
    assert marker.read_text().split() == ["-f", str(compose), "up", "--detach", "--no-build",
                                          "--pull", "never"]  # fmt: skip
    assert "started" in serial.read_text()
    standin.attributes = data.gcp_metadata() | {"umbra-compose-hash": "f" * 64}
    marker.unlink()
    refused = runner.invoke(app, [*base[:-10], "--launch-dir", str(tmp_path / "l2"),
                                  "--console", str(serial), "--compose", str(script)])  # fmt: skip
    assert refused.exit_code == 1
    assert "REFUSED, nothing started: copy_mismatch" in serial.read_text()
    assert not marker.exists()


@pytest.mark.parametrize(
    ("cloud", "user_data", "reason"),
    [
        ("azure", "not base64 at all", "invalid_field"),
        ("azure", "eyJ1bWJyYSI6IFsxXX0=", "invalid_field"),  # {"umbra": [1]}
        ("gcp", None, "missing_field"),
    ],
)
def test_malformed_launch_data_writes_exactly_one_line_on_the_serial_console(
    standin: StandIn, tmp_path: Path, cloud: str, user_data: str | None, reason: str
) -> None:
    """Through the boot's own command: nothing runs, one line says why (nothing else is written
    to the console: no traceback, no partial progress)."""
    serial, marker = tmp_path / "ttyS0", tmp_path / "compose-ran"
    script = tmp_path / "compose"
    script.write_text(f"#!/bin/sh\ntouch {marker}\n")
    script.chmod(0o755)
    extra: list[str] = []
    if cloud == "azure":
        blob = tmp_path / "user-data"
        blob.write_text(user_data or "")
        extra = ["--user-data-file", str(blob)]
    else:
        standin.attributes = {"umbra-role": "dev-cvm", "umbra-app-compose": "{not json"}
    args = ["image", "launch-agent", "--cloud", cloud, "--tee", "simulated", "--no-ingress",
            "--no-idle-stop", "--no-report-ready", "--metadata-url", standin.url,
            "--launch-dir", str(tmp_path / "launch"), "--data-disk", "none",
            "--console", str(serial), "--compose", str(script), *extra]  # fmt: skip
    done = runner.invoke(app, args)
    assert done.exit_code == 1, done.output
    lines = serial.read_text().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("umbra-launch: REFUSED, nothing started: ") and reason in lines[0]
    assert not marker.exists() and not (tmp_path / "launch").exists()
    assert "Traceback" not in done.output


@pytest.mark.parametrize("cloud", ["gcp", "azure"])
def test_launch_data_for_another_vm_starts_nothing(
    standin: StandIn, pki: SimulatedPki, tmp_path: Path, cloud: str
) -> None:
    """Launch data names the VM it was rendered for; on a VM the metadata service names
    otherwise (copied to another CVM) nothing is measured or started, one line says why. Fails
    on the code before: the key was unknown (refused for that, not for the VM)."""
    data, _ = _dev_launch()
    named = replace(data, instance_name="umbra-acme-alice-main-s1234abcd")
    standin.vm_name = "umbra-acme-bob-main-s9999ffff"
    source: Any
    if cloud == "gcp":
        standin.attributes = named.as_metadata()
        source = GcpMetadata(standin.url)
    else:
        (tmp_path / "ud").write_text(named.azure_user_data())
        source = AzureUserData(standin.url, tmp_path / "ud")
    tdx = SimulatedTdx(pki, image="umbra-dev-cvm")
    before = tdx.event_log()
    starter, lines = RecordingStarter(), []
    agent = Agent(source, SimulatedRtmr(tdx), starter, None, tmp_path / "l", lines.append)
    with pytest.raises(LaunchError) as exc:
        agent.run()
    assert exc.value.reason is Refusal.MISMATCH
    assert len(lines) == 1 and "is for VM 'umbra-acme-alice-main-s1234abcd'" in lines[0]
    assert "this VM is 'umbra-acme-bob-main-s9999ffff'" in lines[0]
    assert tdx.event_log() == before and starter.started == []
    assert not (tmp_path / "l").exists()
    # On the VM it names, the same launch data runs.
    standin.vm_name = "umbra-acme-alice-main-s1234abcd"
    agent.launch_dir = tmp_path / "l2"
    assert agent.run().instance_name == "umbra-acme-alice-main-s1234abcd"
    assert len(starter.started) == 1


def test_gcp_launch_data_is_read_and_reported_by_address_not_by_name() -> None:
    """Fails before the fix: the agent dialled `metadata.google.internal`, which the team VPC's
    DNS response policy answers with 0.0.0.0."""
    import ipaddress

    import httpx

    for base in (GcpMetadata().base, GcpGuestAttribute().base):
        assert ipaddress.IPv4Address(httpx.URL(base).host) == ipaddress.IPv4Address(
            "169.254.169.254"
        )


def test_a_ruleset_rendered_for_another_cloud_is_refused(standin: StandIn, tmp_path: Path) -> None:
    # The ready-report rule names one cloud's endpoint: an agent on Azure refuses a GCP ruleset.
    data, _ = _dev_launch()
    gcp = LaunchData(**{**data.__dict__, "security_cvm_ips": ("10.20.1.10",), "cloud": "gcp"})
    standin.user_data = gcp.azure_user_data()
    lines: list[str] = []
    agent = Agent(
        AzureUserData(standin.url), LogOnly(), RecordingStarter(), None, tmp_path / "l",
        lines.append, cloud="azure",
    )  # fmt: skip
    with pytest.raises(LaunchError) as exc:
        agent.run()
    assert exc.value.reason is Refusal.MISMATCH and "umbra-host-firewall" in lines[-1]


def test_a_security_cvm_mounts_its_data_disk_and_makes_the_spool_the_proxys(
    standin: StandIn, tmp_path: Path
) -> None:
    """Fails before the fix: only a Dev CVM mounted its data disk; the proxy's spool was tmpfs."""
    import os

    from umbra.sandbox.render import SERVICE_UID

    @dataclass
    class Disk:
        mounted: int = 0

        def mount(self) -> str:
            self.mounted += 1
            return "data disk mounted"

    m = measure(security_definition())
    data = LaunchData(
        role="security-cvm", team="team-a", cvm_id=CONSOLE_ID, app_compose=m.app_compose.decode()
    )
    standin.user_data = data.azure_user_data()
    disk, lines = Disk(), []
    spool = tmp_path / "data/spool"
    Agent(
        AzureUserData(standin.url), LogOnly(), RecordingStarter(), None, tmp_path / "launch",
        lines.append, data_disk=disk, spool_dir=spool,
    ).run()  # fmt: skip
    assert disk.mounted == 1 and "umbra-launch: data disk mounted" in lines
    st = spool.stat()
    assert st.st_mode & 0o777 == 0o700
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (SERVICE_UID, SERVICE_UID)


def test_a_dev_cvm_arms_idle_stop_and_a_security_cvm_never_does(
    standin: StandIn, pki: SimulatedPki, tmp_path: Path
) -> None:
    """Fails before the fix: nothing started the idle timer (and its config named the forwarder's
    old SSH port and a sessions path the host does not have)."""
    from umbra.components.idle_stop import IdleConfig

    @dataclass
    class Recorder:
        configs: list[IdleConfig] = field(default_factory=list)
        fail: bool = False

        def start(self, config: IdleConfig) -> None:
            if self.fail:
                raise OSError("systemctl start --no-block umbra-idle.timer failed (exit 5)")
            self.configs.append(config)

    data, _ = _dev_launch()
    standin.attributes = data.gcp_metadata()
    armed, lines = Recorder(), []
    Agent(
        GcpMetadata(standin.url), SimulatedRtmr(SimulatedTdx(pki, image="umbra-dev-cvm")),
        RecordingStarter(), None, tmp_path / "a", lines.append, idle_stop=armed,
    ).run()  # fmt: skip
    (config,) = armed.configs
    assert config.ssh_port == 8022  # the attested ingress, a host process
    # The sandbox's dtach sockets inside its mounted tree (sandbox/dev_host.py).
    assert config.sessions_dir == "/run/umbra-sandbox/dev-alice-1/rootfs/run/umbra-sessions"
    assert "umbra-launch: idle auto-stop armed (60 min)" in lines
    # A failure to arm is said, and starts nothing less (it saves cost, it guards nothing).
    lines.clear()
    Agent(
        GcpMetadata(standin.url), SimulatedRtmr(SimulatedTdx(pki, image="umbra-dev-cvm")),
        RecordingStarter(), None, tmp_path / "b", lines.append, idle_stop=Recorder(fail=True),
    ).run()  # fmt: skip
    assert any("WARNING idle auto-stop NOT armed" in ln for ln in lines)
    m = measure(security_definition())
    sec = LaunchData(
        role="security-cvm", team="team-a", cvm_id=CONSOLE_ID, app_compose=m.app_compose.decode()
    )
    standin.attributes = sec.gcp_metadata()
    never = Recorder()
    Agent(
        GcpMetadata(standin.url), LogOnly(), RecordingStarter(), None, tmp_path / "c",
        lambda _l: None, idle_stop=never,
    ).run()  # fmt: skip
    assert never.configs == []


def test_the_image_gets_the_idle_script_and_units_not_enabled(tmp_path: Path) -> None:
    from umbra.components.idle_stop import SCRIPT_PATH, install_files

    written = install_files(tmp_path)
    script = tmp_path / SCRIPT_PATH.lstrip("/")
    assert script in written and b"import umbra" not in script.read_bytes()  # stdlib only
    service = (tmp_path / "etc/systemd/system/umbra-idle.service").read_text()
    assert (
        f"ExecStart=/opt/python/bin/python3 {SCRIPT_PATH} --config /run/umbra/idle.json" in service
    )
    assert not list(tmp_path.rglob("*.wants"))  # not enabled: the launch agent starts it


def test_a_dev_cvm_starts_its_host_definition_through_the_dev_host(
    standin: StandIn, tmp_path: Path
) -> None:
    """The Dev CVM's measured document is dev-cvm.json: the agent writes exactly its bytes and
    hands them to the dev host (`umbra sandbox host up`), never to the compose runner."""
    from umbra.images.launch_agent import DevHostStart

    data, m = _dev_launch()
    standin.attributes = data.gcp_metadata()
    compose, dev_host = RecordingStarter(), RecordingStarter()
    Agent(
        GcpMetadata(standin.url), LogOnly(), compose, None, tmp_path / "launch", lambda _: None,
        dev_host=dev_host,
    ).run()  # fmt: skip
    assert compose.started == [] and dev_host.started == [m.compose.text]
    assert (tmp_path / "launch/dev-cvm.json").read_text() == m.compose.text
    assert not (tmp_path / "launch/docker-compose.yaml").exists()
    # The real starter's command line, and its failure as this launch's START_FAILED.
    script = tmp_path / "host-up"
    script.write_text(
        '#!/bin/sh\necho "$@" > "$0.args"; echo "sandbox_image: not built" >&2; exit 1\n'
    )
    script.chmod(0o755)
    starter = DevHostStart(tmp_path / "root", tmp_path / "img", argv=(str(script),))
    with pytest.raises(LaunchError) as exc:
        starter.start(tmp_path / "launch/dev-cvm.json")
    assert exc.value.reason is Refusal.START_FAILED and "sandbox_image: not built" in str(exc.value)
    assert (tmp_path / "host-up.args").read_text().split() == [
        "--definition", str(tmp_path / "launch/dev-cvm.json"), "--root", str(tmp_path / "root"),
        "--image-dir", str(tmp_path / "img"),
    ]  # fmt: skip
    assert starter.sandbox_pid_file() == tmp_path / "root/sandbox.pid"


def test_the_app_compose_must_fit_the_role(standin: StandIn, tmp_path: Path) -> None:
    from umbra.images.launch_agent import parse_launch_data as parse

    def parse_launch_data(meta: dict[str, str]) -> object:
        return parse({k: v for k, v in meta.items() if k.startswith("umbra-")})

    data, m = _dev_launch()
    sec = measure(security_definition())
    # A Dev CVM given a (non-placeholder) compose file: the old layout, refused.
    wrong = LaunchData(**{**data.__dict__, "app_compose": sec.app_compose.decode()})
    with pytest.raises(LaunchError, match="a Dev CVM release is a host definition"):
        parse_launch_data(wrong.gcp_metadata())
    # A Security CVM given a host definition.
    swapped = LaunchData(
        role="security-cvm", team="team-a", cvm_id=CONSOLE_ID, app_compose=m.app_compose.decode()
    )
    with pytest.raises(LaunchError, match="only a Dev CVM runs a host definition"):
        parse_launch_data(swapped.gcp_metadata())
    # A host definition whose measured address is not the topology's: refused before anything.
    doc = json.loads(m.app_compose)
    host = json.loads(doc["dev_cvm_host"])
    host["network"]["forwarder"] = "10.232.1.1"
    doc["dev_cvm_host"] = canonical_json(host)
    bad = LaunchData(**{**data.__dict__, "app_compose": canonical_json(doc)})
    with pytest.raises(LaunchError) as exc:
        parse_launch_data(bad.gcp_metadata())
    assert exc.value.reason is Refusal.INVALID
    assert "network.forwarder: 10.232.1.1 is not the runc topology's 10.231.1.1" in str(exc.value)


def test_cli_on_tdx_without_a_ccel_writes_one_line_and_measures_nothing(
    standin: StandIn, tmp_path: Path
) -> None:
    """`--tee tdx` reads the firmware's log before measuring: a machine without the CCEL table
    refuses in one line (and never reaches the RTMR3 file, which this host does not have)."""
    data, _ = _dev_launch()
    standin.attributes = data.gcp_metadata()
    serial, marker = tmp_path / "ttyS0", tmp_path / "compose-ran"
    script = tmp_path / "compose"
    script.write_text(f"#!/bin/sh\ntouch {marker}\n")
    script.chmod(0o755)
    args = ["image", "launch-agent", "--cloud", "gcp", "--tee", "tdx", "--no-ingress",
            "--no-idle-stop", "--no-report-ready", "--metadata-url", standin.url,
            "--launch-dir", str(tmp_path / "launch"), "--data-disk", "none",
            "--console", str(serial), "--compose", str(script),
            "--ccel", str(tmp_path / "no-CCEL")]  # fmt: skip
    done = runner.invoke(app, args)
    assert done.exit_code == 1, done.output
    lines = serial.read_text().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("umbra-launch: REFUSED, nothing started: firmware_log_unusable")
    assert "no-CCEL" in lines[0]
    assert not marker.exists() and not (tmp_path / "launch").exists()
    usage = runner.invoke(app, [*args[:5], "simulated", *args[6:]])
    assert usage.exit_code == 2 and "--ccel is only for --tee tdx" in usage.output


def test_an_emulated_security_cvm_gets_its_quote_relay_before_the_compose(
    standin: StandIn, tmp_path: Path
) -> None:
    """`--tee emulated`: the proxy's quotes-only relay to the host's module is started in the
    Security CVM's launch directory before the compose (the proxy quotes at its first start);
    a relay that does not start starts nothing. A Dev CVM gets none."""
    from umbra.images.launch_quote_relay import QuoteRelayError

    order: list[str] = []

    @dataclass
    class Relay:
        fail: bool = False

        def start(self, socket: Path) -> None:
            if self.fail:
                raise QuoteRelayError("umbra-tdx-quote: no socket in 60 s")
            order.append(f"relay {socket}")

    @dataclass
    class Compose:
        def start(self, compose: Path) -> None:
            order.append("compose")

    m = measure(security_definition(simulated={"source": "emulated"}))
    sec = LaunchData(
        role="security-cvm", team="team-a", cvm_id=CONSOLE_ID, app_compose=m.app_compose.decode()
    )
    standin.attributes = sec.gcp_metadata()
    lines: list[str] = []
    Agent(
        GcpMetadata(standin.url), LogOnly(), Compose(), None, tmp_path / "a", lines.append,
        quote_relay=Relay(),
    ).run()  # fmt: skip
    assert order == [f"relay {tmp_path / 'a/security/tdx-quote.sock'}", "compose"]
    assert "umbra-launch: TDX quote relay started for the proxy" in lines
    order.clear()
    with pytest.raises(LaunchError, match="no socket in 60 s"):
        Agent(
            GcpMetadata(standin.url), LogOnly(), Compose(), None, tmp_path / "b", lines.append,
            quote_relay=Relay(fail=True),
        ).run()  # fmt: skip
    assert order == [] and "REFUSED, nothing started" in lines[-1]
    data, _ = _dev_launch()
    standin.attributes = data.gcp_metadata()
    Agent(
        GcpMetadata(standin.url), LogOnly(), Compose(), None, tmp_path / "c", lines.append,
        quote_relay=Relay(),
    ).run()  # fmt: skip
    assert order == ["compose"]


def test_a_compose_role_starts_docker_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Docker is not started at boot (a Dev CVM runs no host dockerd): under systemd the agent
    starts docker.service before a compose role's first `docker load`, and a failure there is
    the launch's START_FAILED with systemctl's words; without systemd as init (development
    hosts, CI) it leaves the engine to the caller."""
    from umbra.images.launch_agent import LaunchError, start_docker_engine

    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    systemctl = bin_dir / "systemctl"
    systemctl.write_text(
        f'#!/bin/sh\necho "$@" >> {log}\n[ -z "$FAIL" ] || {{ echo "$FAIL" >&2; exit 1; }}\n'
    )
    systemctl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    none = tmp_path / "docker.sock"
    start_docker_engine(tmp_path / "no-systemd", none)
    assert not log.exists()
    (tmp_path / "systemd").mkdir()
    start_docker_engine(tmp_path / "systemd", none)
    assert log.read_text() == "start docker.service\n"
    monkeypatch.setenv("FAIL", "Unit docker.service not found.")
    with pytest.raises(LaunchError, match=r"systemctl start docker\.service: Unit docker"):
        start_docker_engine(tmp_path / "systemd", none)
    with socket.socket(socket.AF_UNIX) as listening:  # an engine already up: left alone
        listening.bind(str(none))
        start_docker_engine(tmp_path / "systemd", none)
    assert log.read_text().count("start") == 2
