"""The launch agent's host steps with real tools: the `umbra-host-firewall` ruleset validated as a
copy of what its addresses render to, measured (`umbra.host-firewall`, replayed equal to `umbra
image measure --host-firewall`'s prediction, accepted by a verifier holding the binding) and loaded
by real `nft` in a network namespace standing in for the host; /etc/hosts; the enrollment token
(0600, never said, never measured); the data disk formatted only when empty (a loop device)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from umbra.attest.collateral import StaticCollateral
from umbra.attest.eventlog import load_event_log, replay
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx
from umbra.attest.verify import Verifier
from umbra.cli.app import app
from umbra.components import launch_data
from umbra.components.launch_data import LaunchData
from umbra.images import launch_agent
from umbra.images import measure as measure_mod
from umbra.images.launch_agent import Agent, LaunchError, Refusal
from umbra.images.launch_host import (
    DiscoveredDataDisk,
    Ext4DataDisk,
    HostSetupError,
    Nft,
    blkid_probe,
    find_data_disk,
)
from umbra.images.measure import measure

from ..sandbox.fixtures import dev_definition, dev_definition_doc, security_definition
from .simulated_rtmr import SimulatedRtmr

ALICE = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice"
TOKEN = "u12-enroll-" + "Zx9" * 12


@dataclass(frozen=True)
class Given:
    meta: dict[str, str]

    def fetch(self) -> dict[str, str]:
        return self.meta

    def instance_name(self) -> str:
        raise AssertionError("launch data without umbra-instance-name asks no name")


class Started:
    def __init__(self) -> None:
        self.started: list[Path] = []

    def start(self, compose: Path) -> None:
        self.started.append(compose)


def _root(cmd: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, loop devices); CI runs as root")
    if subprocess.run(["sh", "-c", f"command -v {cmd}"], capture_output=True).returncode:
        pytest.skip(f"needs {cmd} (scripts/system-deps installs it)")


@pytest.fixture
def netns() -> Iterator[str]:
    _root("nft")
    name = f"u12-fw-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _dev() -> tuple[LaunchData, measure_mod.Measurement]:
    m = measure(dev_definition())
    data = LaunchData(
        role="dev-cvm",
        team="team-a",
        cvm_id="dev-alice-1",
        app_compose=m.app_compose.decode(),
        ssh_authorized_keys=(ALICE,),
        security_cvm_ips=("10.20.1.10",),
    )
    return data, m


def test_event_names_agree() -> None:
    assert launch_data.HOST_FIREWALL_EVENT == measure_mod.HOST_FIREWALL_EVENT
    assert launch_data.CVM_ID_EVENT == measure_mod.CVM_ID_EVENT


def test_console_addresses_reach_the_forwarder_only_through_the_measured_ruleset(
    tmp_path: Path,
) -> None:
    """A Dev CVM whose team stack gives the Console's addresses: the agent accepts the ruleset
    that admits them (it is what they render to), writes them for the forwarder's enrollment,
    and refuses addresses without a ruleset or a ruleset that does not match them."""
    base, _ = _dev()
    data = LaunchData(
        **{**base.__dict__, "console_ips": ("10.9.0.5",), "console_url": "https://console.test"}
    )
    meta = data.as_metadata()
    parsed = launch_agent.parse_launch_data(meta)
    assert parsed.console_ips == ("10.9.0.5",) and parsed.host_firewall == data.host_firewall
    assert "10.9.0.5" in (data.host_firewall or "")
    boot = launch_agent.BootIdentity.generate()
    launch_agent.write_launch_dir(tmp_path, parsed, [], boot=boot)
    assert (tmp_path / "forwarder/console-ips").read_text() == "10.9.0.5\n"
    # The Security CVM too, by address: the forwarder's container resolves nothing.
    sec = "\n".join(parsed.security_cvm_ips) + "\n"
    assert parsed.security_cvm_ips and (tmp_path / "forwarder/security-cvm-ips").read_text() == sec
    tampered = meta | {launch_data.META_HOST_FIREWALL: base.host_firewall or ""}
    with pytest.raises(LaunchError) as mismatch:
        launch_agent.parse_launch_data(tampered)
    assert mismatch.value.reason is Refusal.MISMATCH
    alone = {
        k: v
        for k, v in meta.items()
        if k not in (launch_data.META_HOST_FIREWALL, launch_data.META_SECURITY_CVM_IPS)
    }
    with pytest.raises(LaunchError) as missing:
        launch_agent.parse_launch_data(alone)
    assert missing.value.reason is Refusal.MISSING


def test_firewall_is_measured_loaded_and_verified(netns: str, tmp_path: Path) -> None:
    data, m = _dev()
    ruleset = data.host_firewall
    assert ruleset is not None
    pki = SimulatedPki.generate()
    tdx = SimulatedTdx(pki, image="umbra-dev-cvm")
    lines: list[str] = []
    started = Started()
    etc = tmp_path / "etc"
    etc.mkdir()
    agent = Agent(
        source=Given(data.as_metadata() | {launch_data.META_ENROLLMENT_TOKEN: TOKEN}),
        extender=SimulatedRtmr(tdx),
        starter=started,
        reporter=None,
        launch_dir=tmp_path / "launch",
        say=lines.append,
        firewall=Nft(("ip", "netns", "exec", netns, "nft")),
        etc_dir=etc,
    )
    agent.run()
    assert len(started.started) == 1
    # Loaded for real: the namespace now holds the table, with its default-drop chains.
    listed = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "list", "table", "inet", "umbra_host"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "policy drop" in listed and "10.20.1.10" in listed
    assert (etc / "hosts").read_text().splitlines()[-1] == "10.20.1.10 security-cvm.umbra.internal"
    # Measured: umbra image measure --host-firewall predicts the same RTMR3.
    fw = tmp_path / "ruleset.nft"
    fw.write_text(ruleset)
    log = load_event_log((tmp_path / "launch/event-log.json").read_bytes())
    boot = measure_mod.boot_events_of("dev-cvm", log)  # per boot: read from the log, checked
    assert boot is not None
    done = CliRunner().invoke(
        app,
        ["image", "measure", str(_definition_file(tmp_path)), "--cvm-id", "dev-alice-1",
         "--ssh-key", ALICE, "--host-firewall", str(fw), "--json",
         "--boot-id", boot[0], "--ssh-host-key", boot[1]],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    predicted = json.loads(done.stdout)["instance"]["expected_rtmr3"]
    assert replay(log)[3].hex() == tdx.rtmrs()[3].hex() == predicted
    # The firewall is the last launch-bound event; the per-boot events follow it.
    names = [e.name for e in log if e.imr == 3]
    assert names[-3:] == ["umbra.host-firewall", "umbra.boot-id", "umbra.ssh-host-key"]
    binding = m.binding("dev-alice-1", [ALICE], ruleset)
    verifier = Verifier(
        MeasurementPolicy(release=m.release, binding=binding),
        StaticCollateral(pki.collateral(int(time.time()) - 60)),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    verdict = verifier.verify(tdx.quote(b"nonce"), event_log=tdx.event_log())
    assert verdict.ok, verdict.reasons
    assert "umbra.host-firewall" in verdict.events_checked
    # A binding without the firewall event refuses the quote (other runtime events: refuse).
    bare = Verifier(
        MeasurementPolicy(release=m.release, binding=m.binding("dev-alice-1", [ALICE])),
        StaticCollateral(pki.collateral(int(time.time()) - 60)),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    refused = bare.verify(tdx.quote(b"nonce"), event_log=tdx.event_log())
    assert not refused.ok
    assert "runtime events not in the policy: umbra.host-firewall" in refused.reasons
    # The enrollment token: only the forwarder's uid reads it (root's: on a Dev CVM the
    # forwarder is a host process), never said, never measured; the forwarder's enrollment also
    # gets the TD's event log and the Console's addresses.
    forwarder = tmp_path / "launch/forwarder"
    token = forwarder / "enrollment-token"
    assert token.read_text() == TOKEN + "\n" and token.stat().st_mode & 0o777 == 0o400
    assert token.stat().st_uid == 0
    assert not (tmp_path / "launch/enrollment-token").exists()
    assert (forwarder / "event-log.json").read_text() == (
        tmp_path / "launch/event-log.json"
    ).read_text()
    everything = "\n".join(lines) + (tmp_path / "launch/event-log.json").read_text()
    assert TOKEN not in everything


def _definition_file(tmp_path: Path) -> Path:
    import yaml

    path = tmp_path / "definition.yaml"
    path.write_text(yaml.safe_dump(dev_definition_doc()))
    return path


def _mutations() -> list[tuple[str, Refusal, dict[str, str]]]:
    data, _ = _dev()
    meta = data.as_metadata()
    ruleset = meta[launch_data.META_HOST_FIREWALL]
    sec = LaunchData(
        role="security-cvm",
        team="team-a",
        cvm_id="sec-1",
        app_compose=measure(security_definition()).app_compose.decode(),
    ).as_metadata()
    return [
        (
            "extra-rule",
            Refusal.MISMATCH,
            meta
            | {
                launch_data.META_HOST_FIREWALL: ruleset.replace(
                    "counter drop\n  }", "accept\n  }", 1
                )
            },
        ),
        (
            "firewall-without-ips",
            Refusal.MISSING,
            {k: v for k, v in meta.items() if k != launch_data.META_SECURITY_CVM_IPS},
        ),
        (
            "ips-not-ipv4",
            Refusal.INVALID,
            meta | {launch_data.META_SECURITY_CVM_IPS: "sec.example"},
        ),
        (
            "firewall-on-security-cvm",
            Refusal.INVALID,
            sec
            | {
                launch_data.META_HOST_FIREWALL: ruleset,
                launch_data.META_SECURITY_CVM_IPS: "10.20.1.10",
            },
        ),
        ("token-shape", Refusal.INVALID, meta | {launch_data.META_ENROLLMENT_TOKEN: "short"}),
        ("tunnel-credential", Refusal.UNKNOWN, meta | {"umbra-tunnel-credential": TOKEN}),
        ("resolvers-on-dev", Refusal.INVALID, meta | {launch_data.META_DNS_RESOLVERS: "8.8.8.8"}),
        (
            "resolver-loopback",
            Refusal.INVALID,
            sec | {launch_data.META_DNS_RESOLVERS: "127.0.0.53"},
        ),
    ]


@pytest.mark.parametrize(("what", "reason", "meta"), _mutations(), ids=lambda x: str(x))
def test_bad_host_launch_data_starts_nothing(
    what: str, reason: Refusal, meta: dict[str, str], tmp_path: Path
) -> None:
    tdx = SimulatedTdx(SimulatedPki.generate(), image="umbra-dev-cvm")
    before = tdx.rtmrs()[3]
    lines: list[str] = []
    started = Started()
    agent = Agent(Given(meta), SimulatedRtmr(tdx), started, None, tmp_path / "l", lines.append,
                  firewall=Nft(("false",)), etc_dir=tmp_path)  # fmt: skip
    with pytest.raises(LaunchError) as exc:
        agent.run()
    assert exc.value.reason is reason, exc.value
    assert tdx.rtmrs()[3] == before and started.started == [] and not (tmp_path / "l").exists()
    assert TOKEN not in "\n".join(lines)


def test_a_firewall_that_does_not_load_starts_nothing(tmp_path: Path) -> None:
    data, _ = _dev()
    lines: list[str] = []
    started = Started()
    tdx = SimulatedTdx(SimulatedPki.generate(), image="umbra-dev-cvm")
    agent = Agent(Given(data.as_metadata()), SimulatedRtmr(tdx), started, None,
                  tmp_path / "l", lines.append, firewall=Nft(("false",)), etc_dir=tmp_path)  # fmt: skip
    with pytest.raises(LaunchError) as exc:
        agent.run()
    assert exc.value.reason is Refusal.HOST_SETUP_FAILED and started.started == []
    assert "REFUSED, nothing started: host_setup_failed" in lines[-1]


@pytest.fixture
def loop_disk(tmp_path: Path) -> Iterator[Path]:
    _root("mkfs.ext4")
    img = tmp_path / "u12-data.img"
    with img.open("wb") as f:
        f.truncate(64 << 20)
    dev = subprocess.run(
        ["losetup", "--find", "--show", str(img)], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        yield Path(dev)
    finally:
        subprocess.run(["umount", str(tmp_path / "mnt")], capture_output=True, check=False)
        subprocess.run(["losetup", "-d", dev], check=False)


def test_data_disk_is_formatted_only_when_empty(loop_disk: Path, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    disk = Ext4DataDisk(loop_disk, mnt)
    assert "formatted (it was empty)" in disk.mount()
    (mnt / "work.txt").write_text("the developer's work")
    subprocess.run(["umount", str(mnt)], check=True)
    assert "(it was empty)" not in disk.mount()  # the next boot keeps it
    assert (mnt / "work.txt").read_text() == "the developer's work"
    subprocess.run(["umount", str(mnt)], check=True)
    subprocess.run(["mkswap", str(loop_disk)], capture_output=True, check=True)
    with pytest.raises(HostSetupError, match="not ext4: refusing"):
        disk.mount()
    with pytest.raises(HostSetupError, match="not attached"):
        Ext4DataDisk(tmp_path / "absent", mnt).mount()


# ---- the data disk, found in sysfs (no google-*/azure udev names) ---------------------------


def _sysfs(root: Path, disks: dict[str, dict[str, object]]) -> Path:
    """A /sys/block stand-in: per disk its size, removable, ro, partitions and holders."""
    block = root / "sys-block"
    for name, spec in disks.items():
        d = block / name
        (d / "holders").mkdir(parents=True)
        (d / "size").write_text(f"{spec.get('size', 209715200)}\n")
        (d / "removable").write_text(f"{spec.get('removable', 0)}\n")
        (d / "ro").write_text(f"{spec.get('ro', 0)}\n")
        for part in spec.get("parts", []):  # type: ignore[attr-defined]
            (d / part).mkdir()
            (d / part / "partition").write_text("1\n")
        for holder in spec.get("holders", []):  # type: ignore[attr-defined]
            (d / "holders" / holder).touch()
    return block


def _probe(table: dict[str, tuple[str, str]]) -> Callable[[Path], tuple[str, str]]:
    return lambda device: table.get(device.name, ("", ""))


BOOT = {"parts": ["nvme0n1p1", "nvme0n1p2", "nvme0n1p3"]}


@pytest.mark.parametrize(
    ("cloud", "disks", "expect"),
    [
        # GCP C3: NVMe namespaces, the boot disk partitioned, the data disk blank.
        ("gcp", {"nvme0n1": BOOT, "nvme0n2": {}, "loop0": {}}, "nvme0n2"),
        # Azure: SCSI, OS disk partitioned, the resource disk partitioned NTFS, a DVD.
        ("azure", {"sda": {"parts": ["sda1", "sda15"]}, "sdb": {"parts": ["sdb1"]},
                   "sdc": {}, "sr0": {"removable": 1}}, "sdc"),
    ],
)  # fmt: skip
def test_the_data_disk_is_found_in_sysfs_on_both_clouds(
    tmp_path: Path, cloud: str, disks: dict[str, dict[str, object]], expect: str
) -> None:
    """Fails before the fix: the agent looked for /dev/disk/by-id/google-umbra-data and
    /dev/disk/azure/scsi1/lun0, which only Google's and waagent's udev rules create."""
    assert (
        find_data_disk(_sysfs(tmp_path, disks), Path("/dev"), _probe({})) == Path("/dev") / expect
    )


def test_a_labelled_data_disk_wins_and_ambiguity_is_refused(tmp_path: Path) -> None:
    block = _sysfs(tmp_path, {"vda": BOOT, "vdb": {}, "vdc": {}})
    labelled = _probe({"vdc": ("ext4", "umbra-data")})
    assert find_data_disk(block, Path("/dev"), labelled) == Path("/dev/vdc")  # a later boot
    with pytest.raises(HostSetupError, match=r"ambiguous: none labelled 'umbra-data' among vdb"):
        find_data_disk(block, Path("/dev"), _probe({}))
    both = _probe({"vdb": ("ext4", "umbra-data"), "vdc": ("ext4", "umbra-data")})
    with pytest.raises(HostSetupError, match="ambiguous: vdb, vdc"):
        find_data_disk(block, Path("/dev"), both)
    for spec in ({"ro": 1}, {"size": 0}, {"holders": ["dm-0"]}, {"removable": 1}):
        bare = _sysfs(tmp_path / str(len(str(spec))) / str(id(spec)), {"vda": BOOT, "vdb": spec})
        with pytest.raises(HostSetupError, match="no data disk"):
            find_data_disk(bare, Path("/dev"), _probe({}))


def test_the_discovered_disk_is_formatted_once_and_kept(loop_disk: Path, tmp_path: Path) -> None:
    # A real block device under a fake sysfs name (loop devices are skipped as virtual).
    block = _sysfs(tmp_path, {"vda": BOOT, "vdb": {}})
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "vdb").symlink_to(loop_disk)
    mnt = tmp_path / "mnt"
    disk = DiscoveredDataDisk(mnt, block, dev)
    assert "formatted (it was empty)" in disk.mount()
    subprocess.run(["umount", str(mnt)], check=True)
    assert blkid_probe(dev / "vdb") == ("ext4", "umbra-data")
    assert "(it was empty)" not in disk.mount()


def _fs_bytes(mnt: Path) -> int:
    st = os.statvfs(mnt)
    return st.f_blocks * st.f_frsize


def test_a_grown_data_disk_is_grown_in_the_guest(loop_disk: Path, tmp_path: Path) -> None:
    """The Console grew the disk (`PATCH /cvms/{id} {"data_disk_gb"}`): the next boot's disk step
    grows the filesystem online and keeps the workspace. Fails before the fix: the filesystem
    stayed at its first size."""
    block = _sysfs(tmp_path, {"vda": BOOT, "vdb": {}})
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "vdb").symlink_to(loop_disk)
    mnt = tmp_path / "mnt"
    disk = DiscoveredDataDisk(mnt, block, dev)
    first = disk.mount()
    assert "formatted (it was empty)" in first and "filesystem grown" not in first
    (mnt / "work.txt").write_text("the developer's work")
    before = _fs_bytes(mnt)
    subprocess.run(["umount", str(mnt)], check=True)
    assert "filesystem grown" not in disk.mount()  # same size: nothing to do
    subprocess.run(["umount", str(mnt)], check=True)

    img = tmp_path / "u12-data.img"
    os.truncate(img, 160 << 20)  # the provider extends the disk (qemu: the sparse file)
    subprocess.run(["losetup", "-c", str(loop_disk)], check=True)
    # A grow that fails does not stop the boot: mounted at the old size, one warning.
    failing = DiscoveredDataDisk(mnt, block, dev, resize2fs=("false",))
    said = failing.mount()
    assert "mounted at" in said and "WARNING filesystem not grown, it keeps its size" in said
    assert _fs_bytes(mnt) == before and (mnt / "work.txt").read_text() == "the developer's work"
    subprocess.run(["umount", str(mnt)], check=True)

    said = disk.mount()
    assert "filesystem grown from 64 MiB to 160 MiB" in said, said
    assert _fs_bytes(mnt) > before * 2
    assert (mnt / "work.txt").read_text() == "the developer's work"
    subprocess.run(["umount", str(mnt)], check=True)
    assert "filesystem grown" not in disk.mount()  # the next boot: already the device's size
