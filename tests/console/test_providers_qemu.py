"""The `qemu` provider's fast parts (console/providers_qemu.py): what it refuses, the launch data
its metadata stand-in serves (rendered by components' LaunchData, the token included and kept out
of every file and of provider_state), the QEMU command line of each cloud shape, the data disk
kept across stop/start and update, a reset followed by a new TD, and destroy. QEMU itself is
replaced by a recorder here; the boot of the real image in both shapes is
tests/images/test_emulated_walkthrough.py."""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from umbra.attest.simpki import SimulatedPki
from umbra.components.launch_data import LaunchData
from umbra.components.ports import DEV_ATTESTED_SSH_PORT
from umbra.console.config import Settings
from umbra.console.enums import CvmKind
from umbra.console.providers import (
    CvmSpec,
    ProviderError,
    ProviderEvent,
    ProviderUnsupported,
    build_providers,
)
from umbra.console.providers_qemu import GuestForward, QemuCvmProvider, QemuCvmSettings
from umbra.emulated.metadata import Shape
from umbra.emulated.qemu import QemuVm, VmConfig, qemu_argv

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice"
KEY2 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHw3TqJz5YwF8M6c2lZ1H0bqkV0mLhJ9rJ2c8K6w4nXy bob"
TOKEN = "tok-6a1c0ffee0ddba11-enroll"
APP_COMPOSE = '{"docker_compose_file":"name: umbra-dev\\n","manifest_version":2}'


class RecordingVm(QemuVm):
    """Records each boot's config; `stop`/`kill`/`reset` record instead of signalling a process,
    and end `watch` with QEMU's reason (under -no-reboot a reset ends the process too)."""

    boots: ClassVar[list[VmConfig]] = []
    stops: ClassVar[list[VmConfig]] = []

    def start(self) -> RecordingVm:
        RecordingVm.boots.append(self.config)
        self.up = True
        self.ended = threading.Event()
        self.reason: str | None = None
        return self

    def running(self) -> bool:
        return self.up

    def _end(self, reason: str | None) -> None:
        self.up, self.reason = False, reason
        self.ended.set()

    def stop(self, timeout: float = 300) -> bool:
        RecordingVm.stops.append(self.config)
        self._end("guest-shutdown")
        return True

    def kill(self) -> None:
        self._end(None)

    def reset(self) -> None:
        self._end("host-qmp-system-reset")

    def watch(self) -> str | None:
        self.ended.wait()
        return self.reason


@pytest.fixture
def settings(tmp_path: Path) -> QemuCvmSettings:
    disk = tmp_path / "disk.raw"
    disk.write_bytes(b"\0" * 512)
    compose = tmp_path / "app-compose.json"
    compose.write_text(APP_COMPOSE)
    SimulatedPki.generate().save(tmp_path / "pki")
    return QemuCvmSettings(
        shape=Shape.gcp, disk=disk, app_compose=compose, runtime_dir=tmp_path / "run",
        console_url="https://console.example.test", data_disk_gb=2,
        simulated_pki=tmp_path / "pki",
    )  # fmt: skip


@pytest.fixture
def provider(settings: QemuCvmSettings) -> Any:
    RecordingVm.boots, RecordingVm.stops = [], []
    p = QemuCvmProvider(settings, RecordingVm)
    yield p
    for cvm_id in list(p._vms):
        p.destroy(_spec(cvm_id), p.ref(cvm_id), lambda _e: None)


def _spec(cvm_id: str = "cvm_00000000000000a1", **kw: Any) -> CvmSpec:
    base: dict[str, Any] = dict(
        id=cvm_id, team="team-a", name="dev1", kind=CvmKind.dev, owner="alice",
        ssh_keys=(KEY,), enrollment_token=TOKEN,
    )  # fmt: skip
    return CvmSpec(**(base | kw))


def _attributes(port: int) -> dict[str, str]:
    r = httpx.get(
        f"http://127.0.0.1:{port}/computeMetadata/v1/instance/attributes/",
        params={"recursive": "true"},
        headers={"Metadata-Flavor": "Google"},
    )
    r.raise_for_status()
    doc: dict[str, str] = r.json()
    return doc


def test_it_refuses_what_it_cannot_launch(provider: QemuCvmProvider) -> None:
    with pytest.raises(ProviderUnsupported, match="launches Dev CVMs"):
        provider.check(_spec(kind=CvmKind.security))
    with pytest.raises(ProviderError, match="at least one SSH key"):
        provider.check(_spec(ssh_keys=()))
    provider.settings.disk.unlink()
    with pytest.raises(ProviderError, match=r"disk .*disk\.raw does not exist"):
        provider.check(_spec())
    with pytest.raises(ProviderError, match="knows no VM"):
        provider.set_running("qemu:cvm_unknown", False)


def test_launch_serves_the_components_launch_data_and_stores_no_token(
    provider: QemuCvmProvider, settings: QemuCvmSettings
) -> None:
    events: list[ProviderEvent] = []
    done = provider.launch(_spec(), events.append)
    assert done.ref == "qemu:cvm_00000000000000a1"
    (config,) = RecordingVm.boots
    # What the DevCvm component renders for a GCP VM, byte for byte, token included.
    want = LaunchData(
        role="dev-cvm", team="team-a", cvm_id="cvm_00000000000000a1", app_compose=APP_COMPOSE,
        ssh_authorized_keys=(KEY,), console_url="https://console.example.test",
        enrollment_token=TOKEN, cloud="gcp",
    ).gcp_metadata()  # fmt: skip
    assert _attributes(config.metadata_port) == want
    # The data disk: a sparse file of the configured size, the VM's own directory.
    assert config.data_disk.stat().st_size == 2 * 1024**3
    assert config.shape is Shape.gcp and config.disk == settings.disk
    # The VM's TDX module: the port QEMU connects, listening, root-only.
    assert config.tdx_module is not None and config.tdx_module.stat().st_mode & 0o777 == 0o600
    assert events and events[0].kind == "booting"
    # The token is in the stand-in's memory only: not in provider_state, not in any file.
    assert TOKEN not in json.dumps(done.state)
    for path in settings.runtime_dir.rglob("*"):
        if path.is_file() and path.name != "data.raw":
            assert TOKEN.encode() not in path.read_bytes(), path


def test_azure_shape_serves_user_data_and_a_wire_server(tmp_path: Path, settings: Any) -> None:
    RecordingVm.boots = []
    p = QemuCvmProvider(settings.model_copy(update={"shape": Shape.azure}), RecordingVm)
    p.launch(_spec(), lambda _e: None)
    try:
        (config,) = RecordingVm.boots
        r = httpx.get(
            f"http://127.0.0.1:{config.metadata_port}/metadata/instance/compute/userData",
            params={"api-version": "2021-01-01", "format": "text"},
            headers={"Metadata": "true"},
        )
        assert json.loads(base64.b64decode(r.text))["umbra"]["umbra-cvm-id"] == _spec().id
        goal = httpx.get(
            f"http://127.0.0.1:{config.wire_port}/machine/?comp=goalstate",
            headers={"x-ms-version": "2012-11-30"},
        )
        assert goal.status_code == 200
    finally:
        p.destroy(_spec(), p.ref(_spec().id), lambda _e: None)


def test_a_security_cvm_gets_the_stacks_launch_data_its_module_and_a_published_tunnel(
    tmp_path: Path, settings: QemuCvmSettings
) -> None:
    sec_compose = tmp_path / "security-app-compose.json"
    sec_compose.write_text('{"docker_compose_file":"name: umbra-security\\n","manifest_version":2}')
    RecordingVm.boots = []
    s = settings.model_copy(
        update={"security_app_compose": sec_compose, "security_tunnel_host_port": 18443,
                "forwards": [{"address": "168.1.0.10", "port": 443, "host_port": 18444}]}
    )  # fmt: skip
    p = QemuCvmProvider(QemuCvmSettings.model_validate(s.model_dump()), RecordingVm)
    spec = _spec("cvm_00000000000000b2", kind=CvmKind.security, ssh_keys=())
    with pytest.raises(ProviderError, match="takes no SSH keys"):
        p.check(_spec(kind=CvmKind.security))
    try:
        done = p.launch(spec, lambda _e: None)
        (config,) = RecordingVm.boots
        want = LaunchData(
            role="security-cvm", team="team-a", cvm_id=spec.id,
            app_compose=sec_compose.read_text(), console_url="https://console.example.test",
            enrollment_token=TOKEN, cloud="gcp",
        ).gcp_metadata()  # fmt: skip
        assert _attributes(config.metadata_port) == want
        # Its module measures the Security image; the tunnel is published on the host.
        assert p._vms[spec.id].module.image == "umbra-security-cvm"
        assert config.memory_mb == 2048
        argv = " ".join(qemu_argv(config))
        assert "hostfwd=tcp:127.0.0.1:18443-:8443" in argv
        assert "guestfwd=tcp:168.1.0.10:443-cmd:" in argv and " 127.0.0.1 18444" in argv
        assert done.state["tunnel"] == "127.0.0.1:18443"
        assert TOKEN not in json.dumps(done.state)
    finally:
        p.destroy(spec, p.ref(spec.id), lambda _e: None)


def test_stop_start_and_update_keep_the_data_disk(provider: QemuCvmProvider) -> None:
    ref = provider.launch(_spec(), lambda _e: None).ref
    provider.set_running(ref, False)
    provider.set_running(ref, True)
    provider.update(_spec(ssh_keys=(KEY, KEY2)), ref, lambda _e: None)
    first, second, third = RecordingVm.boots
    assert len(RecordingVm.stops) == 2
    assert first.data_disk == second.data_disk == third.data_disk
    assert [c.serial.name for c in (first, second, third)] == [
        "serial-1.log", "serial-2.log", "serial-3.log",
    ]  # fmt: skip
    # The update is a new launch: the new keys are what the next boot reads.
    keys = _attributes(third.metadata_port)["umbra-ssh-authorized-keys"]
    assert keys == f"{KEY}\n{KEY2}\n"


def _boots(n: int) -> list[VmConfig]:
    end = time.monotonic() + 10
    while len(RecordingVm.boots) < n and time.monotonic() < end:
        time.sleep(0.02)
    return RecordingVm.boots


def test_a_reset_boots_a_new_td_on_the_same_disks_and_a_stop_does_not(
    provider: QemuCvmProvider,
) -> None:
    """A reset (the guest's reboot or the host's reset button) ends QEMU under -no-reboot; the
    provider boots the next one at once, with a new module connection (a fresh TD) and the same
    data disk, as GCP and Azure rebuild a TD. A stop, a guest power-off or a kill is not
    followed by a boot, and a reset that races a stop never revives the VM."""
    ref = provider.launch(_spec(), lambda _e: None).ref
    vm = provider._vms["cvm_00000000000000a1"]
    first = vm.qemu
    assert isinstance(first, RecordingVm)
    first.reset()
    one, two = _boots(2)
    assert two.serial.name == "serial-2.log" and one.data_disk == two.data_disk
    assert vm.qemu is not first and vm.qemu is not None and vm.qemu.running()
    # The guest powered itself off: it stays off (no boot 3).
    second = vm.qemu
    assert isinstance(second, RecordingVm)
    second._end("guest-shutdown")
    time.sleep(0.3)
    assert len(RecordingVm.boots) == 2
    # Started again, then stopped by the Console while a reset arrives: it stays stopped.
    provider.set_running(ref, True)
    assert len(_boots(3)) == 3
    third = vm.qemu
    assert isinstance(third, RecordingVm)
    provider._halt(vm)  # the Console's stop: halting, then the power button
    third.reason = "host-qmp-system-reset"  # as if the reset won the race
    third.ended.set()
    time.sleep(0.3)
    assert len(RecordingVm.boots) == 3


def test_destroy_removes_the_vm_and_its_disk(provider: QemuCvmProvider) -> None:
    ref = provider.launch(_spec(), lambda _e: None).ref
    (config,) = RecordingVm.boots
    provider.destroy(_spec(), ref, lambda _e: None)
    assert not config.data_disk.parent.exists()
    with pytest.raises(httpx.ConnectError):
        _attributes(config.metadata_port)


@pytest.mark.parametrize(
    ("shape", "vendor", "forwards"),
    [
        (Shape.gcp, "manufacturer=Google,product=Google Compute Engine", 1),
        (Shape.azure, "manufacturer=Microsoft Corporation,product=Virtual Machine", 2),
    ],
)
def test_the_qemu_command_line_of_each_shape(
    tmp_path: Path, shape: Shape, vendor: str, forwards: int
) -> None:
    config = VmConfig(
        shape, tmp_path / "disk.raw", tmp_path / "data.raw", tmp_path / "s.log",
        tmp_path / "q.sock", 4001, 4002,
    )  # fmt: skip
    argv = qemu_argv(config)
    assert argv[argv.index("-smbios") + 1] == f"type=1,{vendor}"
    netdev = argv[argv.index("-netdev") + 1]
    # Isolated: the guest reaches nothing but the forwards, each to a loopback stand-in.
    assert "restrict=on" in netdev.split(",")
    assert netdev.count("guestfwd=") == forwards
    assert "guestfwd=tcp:169.254.169.254:80-cmd:" in netdev
    assert netdev.count("127.0.0.1 4001") == 1
    assert ("168.63.129.16:80" in netdev) is (shape is Shape.azure)
    assert argv[argv.index("-accel") + 1] == "tcg" and argv[argv.index("-cpu") + 1] == "max"
    drives = [argv[i + 1] for i, a in enumerate(argv) if a == "-drive"]
    assert drives == [
        f"file={tmp_path / 'disk.raw'},format=raw,if=virtio,snapshot=on",
        f"file={tmp_path / 'data.raw'},format=raw,if=virtio",
    ]


def test_the_console_builds_it_from_its_config(tmp_path: Path, settings: QemuCvmSettings) -> None:
    path = tmp_path / "qemu.json"
    path.write_text(settings.model_dump_json())
    base: dict[str, Any] = {"providers": ["qemu"], "database_url": "sqlite://"}
    built = build_providers(Settings.model_validate(base | {"qemu_cvm_config": path}))
    assert isinstance(built["qemu"], QemuCvmProvider)
    with pytest.raises(ValueError, match="needs qemu_cvm_config"):
        build_providers(Settings.model_validate(base))
    path.write_text(json.dumps({"shape": "aws"}))
    with pytest.raises(ProviderError, match=r"qemu_cvm_config .*qemu\.json"):
        build_providers(Settings.model_validate(base | {"qemu_cvm_config": path}))


def test_the_console_launches_stops_starts_and_destroys_through_it(
    request: pytest.FixtureRequest,
    issuer: Any,
    settings: QemuCvmSettings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the Console's API (SQLite): the provider runs in the provisioning worker, the
    one-time enrollment token the Console minted reaches the stand-in, never provider_state."""
    from tests.console.conftest import new_database
    from tests.console.helpers import new_team, start_server
    from umbra.console import providers_qemu
    from umbra.policy.bundle import generate_key

    monkeypatch.setattr(providers_qemu, "QemuVm", RecordingVm)
    RecordingVm.boots, RecordingVm.stops = [], []
    sec_compose = tmp_path / "security-app-compose.json"
    sec_compose.write_text('{"docker_compose_file":"name: umbra-security\\n","manifest_version":2}')
    config = tmp_path / "qemu.json"
    config.write_text(
        settings.model_copy(update={"security_app_compose": sec_compose}).model_dump_json()
    )
    url, sqlite_path = new_database("sqlite", request)
    server = start_server(
        "sqlite", url, sqlite_path, issuer.url, generate_key(), tmp_path,
        providers=["local", "qemu"], qemu_cvm_config=config,
    )  # fmt: skip
    team = new_team(server, issuer)
    try:
        body = {"name": "emu1", "provider": "qemu", "ssh_keys": [KEY]}
        launched = team.dev.post(f"/api/v1/teams/{team.name}/cvms", json=body)
        assert launched.status_code == 201, launched.text
        cvm = _settle(team, launched.json()["id"])
        assert cvm["state"] == "running" and cvm["provider_ref"] == f"qemu:{cvm['id']}"
        (boot,) = RecordingVm.boots
        served = _attributes(boot.metadata_port)
        assert served["umbra-cvm-id"] == cvm["id"] and served["umbra-team"] == team.name
        token = served["umbra-enrollment-token"]
        assert len(token) >= 16 and token not in json.dumps(cvm)
        path = f"/api/v1/cvms/{cvm['id']}"
        assert team.dev.patch(path, json={"state": "stopped"}).status_code == 200
        assert _settle(team, cvm["id"])["state"] == "stopped" and len(RecordingVm.stops) == 1
        assert team.dev.patch(path, json={"state": "running"}).status_code == 200
        assert _settle(team, cvm["id"])["state"] == "running" and len(RecordingVm.boots) == 2
        assert RecordingVm.boots[1].data_disk == boot.data_disk
        assert team.dev.delete(path).status_code == 200
        assert _settle(team, cvm["id"])["state"] == "destroyed"
        assert not boot.data_disk.parent.exists()
        # A Security CVM the provider boots gets a token minted by the Console too (fails
        # before: only Dev CVM launches minted one; a Security CVM's came from its team stack).
        sec = team.admin.post(f"/api/v1/teams/{team.name}/cvms",
                              json={"name": "emu-sec", "kind": "security", "provider": "qemu"})  # fmt: skip
        assert sec.status_code == 201, sec.text
        sec_info = _settle(team, sec.json()["id"])
        assert sec_info["state"] == "running", sec_info
        served = _attributes(RecordingVm.boots[-1].metadata_port)
        assert served["umbra-role"] == "security-cvm" and served["umbra-cvm-id"] == sec_info["id"]
        assert len(served["umbra-enrollment-token"]) >= 16
        assert served["umbra-enrollment-token"] not in json.dumps(sec_info)
        assert team.admin.delete(f"/api/v1/cvms/{sec_info['id']}").status_code == 200
        assert _settle(team, sec_info["id"])["state"] == "destroyed"
    finally:
        team.close()
        server.stop()


def _settle(team: Any, cvm_id: str, timeout: float = 20) -> dict[str, Any]:
    import time

    deadline = time.monotonic() + timeout
    while True:
        cvm: dict[str, Any] = team.admin.get(f"/api/v1/cvms/{cvm_id}").json()
        if cvm["state"] not in ("launching", "updating", "destroying"):
            return cvm
        assert time.monotonic() < deadline, f"CVM stayed {cvm['state']}"
        time.sleep(0.05)


def test_a_missing_simulated_pki_is_refused_at_start(settings: QemuCvmSettings) -> None:
    """Without the PKI its TDX modules sign with, no VM could measure or enroll: refused with
    the path, before anything boots."""
    bad = settings.model_copy(update={"simulated_pki": settings.runtime_dir / "no-pki"})
    with pytest.raises(ProviderError, match=r"simulated_pki .*no-pki"):
        QemuCvmProvider(bad, RecordingVm)


def test_the_dev_workload_network_and_what_umbra_ssh_is_told(
    settings: QemuCvmSettings, tmp_path: Path
) -> None:
    """With the Console's and the Security CVM's addresses, their forwards and the Dev release:
    launch data names the addresses (the host firewall is rendered from them), QEMU relays
    exactly those, the ingress is published on a loopback port kept across stop/start, and
    provider_state tells `umbra ssh` where, against which release and firewall."""
    from umbra.console.session_info import EVENTS_KEY, INGRESS_KEY, RELEASE_KEY
    from umbra.images.measure import measure

    from ..sandbox.fixtures import dev_definition

    release = measure(dev_definition()).release
    (tmp_path / "release.json").write_text(release.model_dump_json(exclude_none=True))
    dev = QemuCvmSettings.model_validate(
        settings.model_dump()
        | {
            "console_ips": ["168.1.0.10"],
            "security_cvm_ips": ["168.1.0.20"],
            "forwards": [
                {"address": "168.1.0.10", "port": 443, "host_port": 4443},
                {"address": "168.1.0.20", "port": 8443, "host_port": 4444},
            ],
            "release_manifest": tmp_path / "release.json",
        }
    )
    RecordingVm.boots, RecordingVm.stops = [], []
    p = QemuCvmProvider(dev, RecordingVm)
    try:
        done = p.launch(_spec(), lambda _e: None)
        p.set_running(done.ref, False)
        p.set_running(done.ref, True)
        first, second = RecordingVm.boots
        served = _attributes(first.metadata_port)
        assert served["umbra-console-ips"] == "168.1.0.10"
        assert served["umbra-security-cvm-ips"] == "168.1.0.20"
        netdev = qemu_argv(first)[qemu_argv(first).index("-netdev") + 1]
        assert "guestfwd=tcp:168.1.0.10:443-cmd:" in netdev and "127.0.0.1 4443" in netdev
        assert "guestfwd=tcp:168.1.0.20:8443-cmd:" in netdev and "127.0.0.1 4444" in netdev
        # The ingress on one loopback port, the same after a stop and start.
        (ingress,) = first.published
        assert second.published == first.published
        assert ingress.guest_port == DEV_ATTESTED_SSH_PORT
        assert f"hostfwd=tcp:127.0.0.1:{ingress.host_port}-:{ingress.guest_port}" in netdev
        state = done.state
        assert state[INGRESS_KEY] == {"host": "127.0.0.1", "port": ingress.host_port}
        assert state[RELEASE_KEY] == release.model_dump(mode="json", exclude_none=True)
        want = p.launch_data(_spec()).expected_events()
        assert state[EVENTS_KEY] == want and "umbra.host-firewall" in want
    finally:
        p.destroy(_spec(), p.ref(_spec().id), lambda _e: None)
    # A forward QEMU cannot relay, and a release that does not load: refused at start.
    outside = dev.model_copy(
        update={"forwards": [GuestForward(address="10.0.0.1", port=443, host_port=4443)]}
    )
    with pytest.raises(ProviderError, match=r"must be inside 168\.0\.0\.0/6"):
        QemuCvmProvider(outside, RecordingVm)
    (tmp_path / "release.json").write_text("{}")
    with pytest.raises(ProviderError, match=r"release_manifest .*release\.json"):
        QemuCvmProvider(dev, RecordingVm)
