"""`umbra up --runtime qemu`'s wiring, without booting anything: its options checked together,
the Console's and the qemu provider's configuration it renders (validated by the provider's own
model, loaded by the Console's own provider factory), the measured Dev release, the errors (no
QEMU, no OVMF, a failed image build, a port in use), the measured Security release, KVM's
probe, and finding, showing and
stopping the stack's VMs (a stand-in process named qemu-system-x86_64 that speaks QMP). The boot
of the real image through the Console is tests/up/test_up_qemu_boot.py."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from umbra.attest.simpki import SimulatedPki
from umbra.cli import up_check_qemu, up_stack
from umbra.cli.app import app
from umbra.cli.up_stack import os_disk, qemu, vms
from umbra.cli.up_stack.material import tls_identity
from umbra.components.host_firewall import HostFirewall
from umbra.components.ports import SECURITY_TUNNEL_PORT
from umbra.console.config import settings_from_env
from umbra.console.providers import build_providers
from umbra.console.providers_qemu import QemuCvmProvider, load_settings
from umbra.contracts.keys import write_key_pair
from umbra.emulated.metadata import Shape
from umbra.images.build import BuildError
from umbra.policy.bundle import generate_key

from .test_up import _free_base

DIGEST = "sha256:" + "cd" * 32


def _cli(*args: str) -> tuple[int, str]:
    done = CliRunner().invoke(app, ["up", *args], env={"NO_COLOR": "1", "COLUMNS": "200"})
    return done.exit_code, done.output


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--runtime", "runc", "--shape", "gcp"], "--shape only with --runtime qemu"),
        (["--runtime", "runc", "--accel", "kvm"], "--accel only with --runtime qemu"),
        (["--runtime", "vmware"], "--runtime 'vmware': one of runc, qemu"),
        (["--runtime", "qemu", "--shape", "aws"], "--shape 'aws': one of gcp, azure"),
        (["--runtime", "qemu", "--accel", "hvf"], "--accel 'hvf': one of auto, kvm, tcg"),
        (["--runtime", "qemu", "--check", "--internet"], "not with --runtime qemu"),
        (["--runtime", "qemu", "--short"], "--short only with --check and --runtime"),
        (["--runtime", "runc", "--check", "--short"], "--short only with --check"),
    ],
)
def test_options_are_checked_together_before_anything_runs(
    args: list[str], said: str, tmp_path: Path
) -> None:
    code, out = _cli("--state-dir", str(tmp_path / "s"), *args)
    assert code == 2, out
    assert said in " ".join(out.split())
    assert not (tmp_path / "s").exists()  # nothing was started or written


def test_the_state_directory_keeps_its_runtime_and_shape(tmp_path: Path) -> None:
    """`umbra up` without --runtime keeps the state directory's; a change while its Console
    runs is refused (checked before anything starts)."""
    from umbra.cli.up import _switch_runtime

    s = up_stack.Stack(tmp_path, 7080)
    _switch_runtime(s, "qemu", "azure", "auto", False)
    assert (s.state["runtime"], s.state["shape"]) == ("qemu", "azure")
    _switch_runtime(s, None, None, "auto", False)  # a later `umbra up`
    assert (s.state["runtime"], s.state["shape"]) == ("qemu", "azure")
    with pytest.raises(up_stack.UpError, match="--internet runs pip and git"):
        _switch_runtime(s, None, None, "auto", True)
    _switch_runtime(s, "runc", None, "auto", False)
    assert s.state["runtime"] == "runc" and "shape" not in s.state
    with pytest.raises(up_stack.UpError, match="--shape and --accel only with --runtime qemu"):
        _switch_runtime(s, None, "gcp", "auto", False)
    _switch_runtime(s, "qemu", None, "auto", False)
    assert s.state["shape"] == "gcp"


@pytest.fixture
def stack(tmp_path: Path) -> up_stack.Stack:
    s = up_stack.Stack(tmp_path / "state", _free_base(), progress=lambda _m: None)
    s.state_dir.mkdir()
    s.state.update(runtime="qemu", shape="azure")
    SimulatedPki.generate().save(s.p("pki"))
    (s.p("security-cvm")).mkdir()
    from umbra.attest.simulator import SimulatedTdx

    release = SimulatedTdx(SimulatedPki.load(s.p("pki")), image="umbra-security-cvm")
    doc = release.release_manifest().model_dump(mode="json", exclude_none=True)
    s.p("security-cvm", "release.json").write_text(json.dumps(doc))
    s.p("keys").mkdir()
    s.p("keys", "console-kek").write_text(f"k1={base64.b64encode(os.urandom(32)).decode()}\n")
    write_key_pair(generate_key(), s.p("keys", "dev-release.pem"))
    tls_identity(s.p("demo-origin"), up_stack.names.ORIGIN_NAMES)
    return s


def test_the_console_gets_the_qemu_provider_with_a_config_it_loads(
    stack: up_stack.Stack, tmp_path: Path
) -> None:
    disk = tmp_path / "disk.raw"
    disk.write_bytes(b"\0" * 512)
    qemu.write_security_release(stack, DIGEST)
    qemu.write_dev_release(stack)
    path = qemu.write_provider_config(stack, disk, "tcg")
    settings = load_settings(path)
    assert settings.shape is Shape.azure and settings.disk == disk and settings.accel == "tcg"
    assert settings.runtime_dir == stack.p("qemu") and settings.simulated_pki == stack.p("pki")
    # The VM enrolls at the Console's name over TLS (its front's CA in launch data).
    assert settings.console_url == "https://console.umbra.internal"
    assert settings.console_ca == stack.p("console-tls", "ca.pem")
    # The Dev workload's network.
    doc = json.loads(path.read_text())
    assert doc["console_ips"] == [qemu.CONSOLE_IP]
    assert doc["security_cvm_ips"] == [qemu.SECURITY_IP]
    # The Console and the Security CVM's tunnel for the Dev VM; the stand-in origins and the PCCS
    # for the Security VM, each on its own port.
    assert doc["forwards"] == [
        {"address": qemu.CONSOLE_IP, "port": 443, "host_port": stack.port("console_tls")},
        {"address": qemu.SECURITY_IP, "port": SECURITY_TUNNEL_PORT,
         "host_port": stack.port("tunnel")},
        *({"address": ip, "port": stack.port(name), "host_port": stack.port(name)}
          for ip, name in ((qemu.ORIGIN_IP, "origin"), (qemu.ORIGIN_IP, "llm"),
                           (qemu.PCCS_IP, "pccs"))),
    ]  # fmt: skip
    # The Security VM: its measured compose, its tunnel published on the stack's tunnel port.
    assert settings.security_app_compose == stack.p("qemu", "security-app-compose.json")
    assert settings.security_tunnel_port == SECURITY_TUNNEL_PORT
    assert settings.security_tunnel_host_port == stack.port("tunnel")
    # The Dev release dials the Security CVM on the port its host firewall admits (the clouds'
    # tunnel port; before, the stack's loopback port: every dial timed out in the VM).
    firewall = HostFirewall(security_cvm_ips=(qemu.SECURITY_IP,), console_ips=(qemu.CONSOLE_IP,))
    assert firewall.tunnel_port == SECURITY_TUNNEL_PORT
    assert doc["release_manifest"] == str(stack.p("dev-cvm-release.json"))
    # The launch data's compose is the measured Dev release's, whose compose hash the release
    # the Console verifies enrollment quotes against pins.
    compose = settings.app_compose.read_bytes()
    release = json.loads(stack.p("dev-cvm-release.json").read_text())
    (event,) = [e for e in release["events"] if e["name"] == "compose-hash"]
    assert event["payloads"] == [hashlib.sha256(compose).hexdigest()]
    assert release["tee"] == "simulated"
    # It names the stack's simulated root (the local Security CVM's quotes chain to it), which
    # the dev host in the VM hands its forwarder.
    host = json.loads(json.loads(compose)["dev_cvm_host"])
    assert host["forwarder"]["security_cvm"] == {
        "host": qemu.SECURITY_IP,
        "port": SECURITY_TUNNEL_PORT,
    }
    assert host["simulated_root"] == stack.p("pki", "root.pem").read_text()
    # ... and pins the Security release, which pins the compose the Security VM is launched with.
    security = json.loads(stack.p("security-cvm", "release.json").read_text())
    assert host["forwarder"]["security_cvm_release"] == security
    (event,) = [e for e in security["events"] if e["name"] == "compose-hash"]
    security_compose = settings.security_app_compose.read_bytes()
    assert event["payloads"] == [hashlib.sha256(security_compose).hexdigest()]
    # The Console's own settings and provider factory take it (the local provider stays: it
    # holds the Security CVM's record).
    env = up_stack.console_env(stack)
    console_settings = settings_from_env(env)
    assert console_settings.providers == ["local", "qemu"]
    providers = build_providers(console_settings.model_copy(update={"providers": ["qemu"]}))
    assert isinstance(providers["qemu"], QemuCvmProvider)
    assert providers["qemu"].settings.shape is Shape.azure
    # The Security CVM's tunnel endpoint: on loopback, where the VM's relay dials it.
    stack.state["security_cvm_id"] = "cvm_0000000000000001"
    argv = " ".join(up_stack.proxy_argv(stack))
    assert f"--tunnel-listen 127.0.0.1:{stack.port('tunnel')}" in argv
    stack.state["runtime"] = "runc"
    assert "providers" not in " ".join(up_stack.console_env(stack)).lower()
    assert f"--tunnel-listen 10.232.0.1:{stack.port('tunnel')}" in " ".join(
        up_stack.proxy_argv(stack)
    )


def test_the_security_release_runs_the_disks_proxy_against_the_stack_by_address(
    stack: up_stack.Stack,
) -> None:
    """The Security VM's measured compose: the proxy image the disk carries, the Console by
    address over TLS by its front's CA, the stack's bundle key, quotes from the VM's TDX module,
    the stack's PCCS, and the stand-in origins by address and CA (test options, which only a
    simulated release takes)."""
    qemu.write_security_release(stack, DIGEST)
    doc = json.loads(stack.p("qemu", "security-app-compose.json").read_text())
    compose = doc["docker_compose_file"]
    assert f"image: umbra/proxy@{DIGEST}" in compose
    assert f'"--console", "https://{qemu.CONSOLE_IP}"' in compose
    assert '"--console-ca", "/run/umbra/launch/console-ca.pem"' in compose
    assert '"--quote-source", "emulated"' in compose
    assert f'"--tunnel-collateral-pccs", "http://{qemu.PCCS_IP}:{stack.port("pccs")}"' in compose
    assert f'"--test-allow-upstream", "{qemu.ORIGIN_IP}/32"' in compose
    key = stack.p("keys", "dev-release.pem.pub").read_text()
    assert json.dumps(key) in compose  # the bundle key, pinned
    resolver = json.dumps({h: [qemu.ORIGIN_IP] for h in sorted(up_stack.names.ORIGIN_NAMES)},
                          separators=(",", ":"))  # fmt: skip
    assert json.dumps(resolver) in compose
    assert json.dumps(stack.p("demo-origin", "ca.pem").read_text()) in compose
    release = json.loads(stack.p("security-cvm", "release.json").read_text())
    assert release["tee"] == "simulated" and release["name"] == "security-cvm-up-qemu"
    # The Console's front answers for that address as well as for the name.
    tls_identity(stack.p("console-tls"), frozenset({qemu.CONSOLE_NAME}),
                 frozenset({qemu.CONSOLE_IP}))  # fmt: skip
    names = up_stack.material._names(stack.p("console-tls", "origin.pem"))
    assert {qemu.CONSOLE_NAME, qemu.CONSOLE_IP, "127.0.0.1"} <= names


def test_kept_vms_and_a_dev_vm_of_another_security_cvm(
    stack: up_stack.Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running VM is kept; one whose QEMU is gone is destroyed for a new launch; a Dev VM still
    running but attached to another (an earlier, relaunched) Security CVM is destroyed too."""
    import httpx

    from umbra.cli.up_stack import devcvm, seed

    records = {
        "cvm_dev": {"id": "cvm_dev", "state": "running", "security_cvm_id": "cvm_old",
                    "ssh_keys": []},
        "cvm_sec": {"id": "cvm_sec", "state": "running"},
    }  # fmt: skip
    deleted: list[str] = []

    def console(request: httpx.Request) -> httpx.Response:
        cvm = request.url.path.rsplit("/", 1)[1]
        if request.method == "DELETE":
            deleted.append(cvm)
            return httpx.Response(202, json={})
        return httpx.Response(200, json=records[cvm])

    client = httpx.Client(transport=httpx.MockTransport(console), base_url="http://console")
    alive = [vms.Vm(1, "cvm_dev", None), vms.Vm(2, "cvm_sec", None)]
    monkeypatch.setattr(seed, "vms", lambda _stack: alive)
    assert seed.kept_vm(stack, client, "cvm_sec", "Security CVM") == records["cvm_sec"]
    assert not devcvm._qemu_vm_usable(stack, client, "cvm_dev", "cvm_sec", [])
    assert deleted == ["cvm_dev"]
    assert devcvm._qemu_vm_usable(stack, client, "cvm_dev", "cvm_old", [])
    alive.pop(1)  # the Security VM's QEMU went with its Console
    assert seed.kept_vm(stack, client, "cvm_sec", "Security CVM") is None
    assert deleted == ["cvm_dev", "cvm_sec"]


def test_switching_runtimes_never_keeps_the_other_runtimes_security_cvm(
    stack: up_stack.Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runc after qemu: the VM's Security CVM record (its VM gone with its Console) is destroyed
    and a new one registered for this host's proxy, even with an old proxy credential on disk;
    qemu after runc: the host proxy's record has no VM, so a VM is launched in its place."""
    import httpx

    from umbra.cli.up_stack import seed

    records: dict[str, dict[str, Any]] = {
        "cvm_vm": {"id": "cvm_vm", "state": "running", "provider": "qemu"},
        "cvm_host": {"id": "cvm_host", "state": "running", "provider": "local"},
    }
    calls: list[str] = []

    def console(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}")
        if request.method == "POST" and request.url.path.endswith("/cvms"):
            doc = json.loads(request.content)
            new = {"id": f"cvm_new{len(records)}", "state": "running",
                   "provider": doc.get("provider", "local")}  # fmt: skip
            records[new["id"]] = new
            return httpx.Response(201, json=new)
        if request.url.path.endswith("/enrollment-token"):
            return httpx.Response(201, json={"token": "tok"})
        cvm = request.url.path.rsplit("/", 1)[1]
        if request.method == "DELETE":
            records[cvm]["state"] = "destroying"
            return httpx.Response(202, json={})
        return httpx.Response(200, json=records[cvm])

    client = httpx.Client(transport=httpx.MockTransport(console), base_url="http://console")
    monkeypatch.setattr(seed, "vms", lambda _stack: [])
    stack.state.update(runtime="runc", security_cvm_id="cvm_vm")
    up_stack.write_secret(stack.p("security-cvm", "console-credential"), b"old")
    made = seed.ensure_security_cvm(stack, client)
    assert made != "cvm_vm" and records[made]["provider"] == "local"
    assert "DELETE /api/v1/cvms/cvm_vm" in calls
    stack.state.update(runtime="qemu", security_cvm_id="cvm_host")
    made = seed.ensure_security_cvm(stack, client)
    assert records[made]["provider"] == "qemu" and "DELETE /api/v1/cvms/cvm_host" in calls


def test_a_bad_provider_config_is_refused_before_the_console_reads_it(
    stack: up_stack.Stack, tmp_path: Path
) -> None:
    stack.state["shape"] = "aws"
    with pytest.raises(up_stack.UpError, match="qemu provider's config: shape"):
        qemu.write_provider_config(stack, tmp_path / "disk.raw", "tcg")


def test_no_qemu_and_no_ovmf_each_get_a_message_and_a_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    code, out = _cli("--runtime", "qemu", "--state-dir", str(tmp_path / "s"),
                     "--port-base", str(_free_base()))  # fmt: skip
    flat = " ".join(out.split())
    if os.geteuid() != 0:
        assert "needs root" in flat
        return
    assert code == 1, out
    assert "error: --runtime qemu needs qemu-system-x86_64, which is not installed" in flat
    assert "fix: apt-get install qemu-system-x86" in flat
    (bin_dir / "qemu-system-x86_64").symlink_to("/bin/true")
    from umbra.emulated import qemu as emulated

    monkeypatch.setattr(emulated, "OVMF", tmp_path / "OVMF.fd")
    with pytest.raises(up_stack.UpError) as missing:
        qemu.preflight()
    assert f"OVMF's UEFI firmware {tmp_path / 'OVMF.fd'}" in str(missing.value)
    assert "apt-get install ovmf" in missing.value.fix


def test_a_failed_image_build_says_why_and_leaves_no_cache_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from umbra.images import build

    monkeypatch.setenv(os_disk.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(os_disk.DISK_ENV, raising=False)
    monkeypatch.setattr(os_disk, "_uv", lambda root, args: _fake_uv(tmp_path, args))

    def broken(*_a: object, **_k: object) -> None:
        raise BuildError("mmdebstrap (OS image) failed: E: cannot reach deb.debian.org")

    monkeypatch.setattr(build, "build_rootfs", broken)  # the proxy image, built first
    with pytest.raises(up_stack.UpError) as failed:
        os_disk.ensure_disk(lambda _m: None)
    assert str(failed.value) == (
        "building the qemu OS image failed: mmdebstrap (OS image) failed: E: cannot reach "
        "deb.debian.org"
    )
    assert "umbra up --runtime qemu" in failed.value.fix
    key = os_disk.inputs_key(os_disk.project_root())
    assert not (tmp_path / "cache" / key).exists()


def _fake_uv(tmp: Path, args: list[str]) -> str:
    if args[0] == "build":
        out = Path(args[args.index("-o") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "umbra-0-py3-none-any.whl").write_bytes(b"")
    return ""


def test_a_given_disk_is_used_as_is_and_a_missing_one_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    monkeypatch.setenv(os_disk.DISK_ENV, str(tmp_path / "none.raw"))
    with pytest.raises(up_stack.UpError, match=r"none\.raw: no such file"):
        os_disk.ensure_disk(said.append)
    (tmp_path / "disk.raw").write_bytes(b"\0")
    monkeypatch.setenv(os_disk.DISK_ENV, str(tmp_path / "disk.raw"))
    # Without the images it carries, the Security release cannot name its proxy.
    with pytest.raises(up_stack.UpError, match=r"images\.json: no proxy image digest"):
        os_disk.ensure_disk(said.append)
    (tmp_path / "images.json").write_text(json.dumps({"proxy": {"manifest_digest": "latest"}}))
    with pytest.raises(up_stack.UpError, match="is not a sha256 digest"):
        os_disk.ensure_disk(said.append)
    (tmp_path / "images.json").write_text(json.dumps({"proxy": {"manifest_digest": DIGEST}}))
    assert os_disk.ensure_disk(said.append) == os_disk.OsDisk(tmp_path / "disk.raw", DIGEST)
    assert said and said[0].startswith("warning:")


def test_the_inputs_key_follows_every_source_file(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    for rel in ("pyproject.toml", "uv.lock", "cli/a.py", "images/os/qemu.yaml"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    first = os_disk.inputs_key(root)
    (root / "cli/__pycache__").mkdir()
    (root / "cli/__pycache__/a.cpython-312.pyc").write_bytes(b"x")
    assert os_disk.inputs_key(root) == first  # bytecode is not an input
    (root / "images/os/qemu.yaml").write_text("changed")
    assert os_disk.inputs_key(root) != first


def test_port_in_use_is_refused_for_the_qemu_runtime_too(stack: up_stack.Stack) -> None:
    if os.geteuid() != 0:
        pytest.skip("preflight needs root")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", stack.port("console")))
        squatter.listen()
        with pytest.raises(up_stack.UpError) as busy:
            up_stack.preflight(stack)
    assert f"port {stack.port('console')} (console) is in use" in str(busy.value)
    assert "--port-base" in busy.value.fix


def test_kvm_is_chosen_only_when_a_paused_guest_survives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        assert qemu.choose_accel() == "tcg"
        return
    aborts, survives = tmp_path / "aborts", tmp_path / "survives"
    aborts.write_text("#!/bin/sh\necho 'failed to set MSR 0x10a' >&2\nexit 134\n")
    survives.write_text("#!/bin/sh\nexec sleep 30\n")
    for script in (aborts, survives):
        script.chmod(0o755)
    monkeypatch.setattr(qemu, "QEMU", str(aborts))
    assert qemu.choose_accel(1.0) == "tcg"
    monkeypatch.setattr(qemu, "QEMU", str(survives))
    assert qemu.choose_accel(1.0) == "kvm"


# A stand-in for QEMU: named qemu-system-x86_64, carrying the stack's marker, answering QMP on
# its -qmp socket; it exits on the power button unless told to ignore it.
FAKE_QEMU = r"""
import json, os, socket, sys, time
qmp = [a for a in sys.argv if a.startswith("unix:")][0][5:].split(",")[0]
ignore = "--ignore-acpi" in sys.argv
s = socket.socket(socket.AF_UNIX); s.bind(qmp); s.listen(1)
while True:
    c, _ = s.accept(); f = c.makefile("rwb")
    f.write(b'{"QMP": {}}\n'); f.flush()
    for line in f:
        cmd = json.loads(line)["execute"]
        f.write(b'{"return": {}}\n'); f.flush()
        if cmd == "system_powerdown" and not ignore:
            time.sleep(0.2); sys.exit(0)
"""


@pytest.fixture
def fake_vms(stack: up_stack.Stack, tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    binary = tmp_path / "bin" / "qemu-system-x86_64"
    binary.parent.mkdir()
    binary.symlink_to(sys.executable)
    (tmp_path / "fake_qemu.py").write_text(FAKE_QEMU)
    procs = []
    for cvm, extra in (("cvm_aaaaaaaaaaaaaaa1", []), ("cvm_aaaaaaaaaaaaaaa2", ["--ignore-acpi"])):
        d = stack.p("qemu", cvm)
        d.mkdir(parents=True)
        argv = [
            str(binary), str(tmp_path / "fake_qemu.py"), "-drive",
            f"file={d / 'data.raw'},format=raw,if=virtio", "-qmp",
            f"unix:{d / 'qmp.sock'},server=on,wait=off", *extra,
        ]  # fmt: skip
        env = {**os.environ, "UMBRA_UP_STATE": str(stack.state_dir)}
        procs.append(subprocess.Popen(argv, env=env))
        end = time.monotonic() + 10
        while not (d / "qmp.sock").exists() and time.monotonic() < end:
            time.sleep(0.05)
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def test_down_presses_the_power_button_then_kills_what_ignores_it(
    stack: up_stack.Stack, fake_vms: list[subprocess.Popen[bytes]]
) -> None:
    found = {vm.cvm_id: vm for vm in vms.vms(stack)}
    assert set(found) == {"cvm_aaaaaaaaaaaaaaa1", "cvm_aaaaaaaaaaaaaaa2"}
    assert found["cvm_aaaaaaaaaaaaaaa1"].pid == fake_vms[0].pid
    # `umbra status` shows the VM `up` launched, with its QEMU.
    stack.state["dev_cvm_id"] = "cvm_aaaaaaaaaaaaaaa1"
    (shown,) = vms.status(stack)
    assert shown["runtime"] == "qemu" and shown["shape"] == "azure"
    assert shown["qemu_pid"] == fake_vms[0].pid and shown["healthy"]
    stack.state["accel"] = "tcg"
    stack.save()
    table = CliRunner().invoke(
        app, ["status", "--state-dir", str(stack.state_dir)], env={"COLUMNS": "200"}
    )
    assert table.exit_code == 1  # the components are not running
    assert "dev cvm cvm_aaaaaaaaaaaaaaa1 (runtime: qemu)" in table.output
    assert f"qemu {fake_vms[0].pid} (azure shape, tcg)" in table.output
    stopped = vms.stop_vms(stack, grace=2)
    assert sorted(stopped) == [
        "qemu vm cvm_aaaaaaaaaaaaaaa1 (acpi)",
        "qemu vm cvm_aaaaaaaaaaaaaaa2 (killed)",
    ]
    assert fake_vms[0].wait(5) == 0  # it shut itself down
    assert fake_vms[1].wait(5) == -9
    assert vms.vms(stack) == []
    (shown,) = vms.status(stack)
    assert shown["qemu_pid"] is None and not shown["healthy"]


def test_a_refused_launch_or_a_dead_qemu_fails_the_boot_step_at_once(
    stack: up_stack.Stack, tmp_path: Path
) -> None:
    serial = tmp_path / "serial-1.log"
    serial.write_text("umbra-launch: REFUSED, nothing started: launch data: bad signature\n")
    boot = up_check_qemu._Boot(1, serial)
    started = time.monotonic()
    with pytest.raises(up_check_qemu.StepFailed, match="REFUSED, nothing started: launch data"):
        up_check_qemu.wait_started(stack, "cvm_x", boot, 60, "dev-cvm")
    serial.write_text("Booting...\n")
    with pytest.raises(up_check_qemu.StepFailed, match="QEMU exited before the launch agent"):
        up_check_qemu.wait_started(stack, "cvm_x", boot, 60, "security-cvm")
    assert time.monotonic() - started < 10


def test_ssh_needs_the_ingress_the_provider_recorded() -> None:
    with pytest.raises(up_check_qemu.StepFailed, match=r"provider_state\.ssh_ingress"):
        up_check_qemu.need_ssh({"provider_state": {"runtime": "qemu"}})


def test_the_consoles_tls_front_relays_for_its_name_only(tmp_path: Path) -> None:
    """What a VM's forwarder dials: TLS for console.umbra.internal by the front's own CA, the
    bytes relayed to the plain loopback Console (here a stand-in HTTP server)."""
    import http.server
    import ssl
    import threading

    from umbra.cli.up_stack.material import tls_identity

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"host={self.headers['Host']} path={self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_a: object) -> None:
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    tls_identity(tmp_path, frozenset({qemu.CONSOLE_NAME}))
    port = _free_base()
    front = subprocess.Popen(
        [sys.executable, "-m", "umbra.cli.tls_front", "--cert", str(tmp_path / "origin.pem"),
         "--key", str(tmp_path / "origin-key.pem"), "--listen", f"127.0.0.1:{port}",
         "--to", f"127.0.0.1:{upstream.server_address[1]}"],
    )  # fmt: skip
    try:
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        end = time.monotonic() + 20
        while True:
            try:
                raw = socket.create_connection(("127.0.0.1", port), 5)
                break
            except OSError:
                assert time.monotonic() < end and front.poll() is None
                time.sleep(0.1)
        with context.wrap_socket(raw, server_hostname=qemu.CONSOLE_NAME) as tls:
            tls.sendall(b"GET /api/v1/enroll HTTP/1.1\r\nHost: console.umbra.internal\r\n"
                        b"Connection: close\r\n\r\n")  # fmt: skip
            answer = b""
            while chunk := tls.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.0 200")
        assert answer.endswith(b"host=console.umbra.internal path=/api/v1/enroll")
        # Another name is not this certificate's.
        with (
            socket.create_connection(("127.0.0.1", port), 5) as raw2,
            pytest.raises(ssl.SSLCertVerificationError),
        ):
            context.wrap_socket(raw2, server_hostname="evil.example")
    finally:
        front.terminate()
        front.wait(10)
        upstream.shutdown()


def test_the_pccs_serves_the_stacks_collateral_to_the_production_client(
    stack: up_stack.Stack,
) -> None:
    """The tunnel endpoint fetches its collateral from `up_pccs` through the client production
    uses (dcap-qvl's, attest.collateral.CollateralRelay) and a forwarder verifies with it."""
    import asyncio

    from umbra.attest.collateral import Collateral, CollateralRelay, PccsCollateral
    from umbra.attest.simpki import SIM_FMSPC
    from umbra.attest.simulator import SimulatedTdx

    port = stack.port("pccs")
    pccs = subprocess.Popen(
        [sys.executable, "-m", "umbra.cli.up_pccs", "--pki", str(stack.p("pki")),
         "--port", str(port)],
    )  # fmt: skip
    try:
        end = time.monotonic() + 20
        while time.monotonic() < end:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            time.sleep(0.1)
        pki = SimulatedPki.load(stack.p("pki"))
        quote = SimulatedTdx(pki, image="umbra-security-cvm").quote(b"\0" * 64)
        relay = CollateralRelay(PccsCollateral([f"http://127.0.0.1:{port}"]))
        data = asyncio.run(relay(quote))
        assert data is not None and relay.last_error is None
        got = Collateral.from_json(data)  # parsed as the forwarder parses a relayed set
        assert got.fmspc.upper() == SIM_FMSPC.hex().upper()
        assert time.time() - 7200 < got.tcb_info_issue_date < time.time()  # re-dated at start
    finally:
        pccs.terminate()
        pccs.wait(10)
    # The Security CVM relays it only on the qemu runtime (a local forwarder reads the file).
    stack.state["security_cvm_id"] = "cvm_0000000000000001"
    assert f"--tunnel-collateral-pccs http://127.0.0.1:{port}" in " ".join(
        up_stack.proxy_argv(stack)
    )
    stack.state["runtime"] = "runc"
    assert "--tunnel-collateral-pccs" not in up_stack.proxy_argv(stack)


def test_ssh_steps_retry_until_the_answer_or_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """`umbra ssh` is retried while the VM comes up; the last attempt decides (no VM here)."""
    answers = iter(["", "garbage\n000", '{"ok": 1}\n200'])
    calls: list[str] = []

    def fake_ssh(cvm_id: str, command: str, timeout: float = 90) -> Any:
        calls.append(command)
        return subprocess.CompletedProcess([], 0, next(answers), "reset")

    monkeypatch.setattr(up_check_qemu, "ssh", fake_ssh)
    monkeypatch.setattr("umbra.cli.up_check_qemu.time.sleep", lambda _s: None)
    done = up_check_qemu.ssh_until("cvm_x", "curl", up_check_qemu._answered(200), 600)
    assert up_check_qemu._status(done) == (200, ['{"ok": 1}']) and len(calls) == 3
    # Past the limit, the last attempt comes back as it is: the caller names what it lacked.
    answers = iter(["1\n403"])
    done = up_check_qemu.ssh_until("cvm_x", "curl", up_check_qemu._answered(200), -1)
    assert up_check_qemu._status(done) == (403, ["1"])
