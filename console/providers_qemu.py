"""The `qemu` provider: the Console launches Dev CVMs on an emulated cloud, as it does on GCP and
Azure, booting the built OS image (`umbra image disks` → `disk.raw`, the `qemu` definition) under
QEMU (umbra.emulated.qemu) in the configured cloud shape, with a metadata stand-in
(umbra.emulated.metadata) serving the launch data rendered by the components' own code
(`LaunchData`: `gcp_metadata()` as components.gcp_vm sets it, `azure_user_data()` as
components.azure_vm does), the enrollment token included.

- A launch boots the VM with a blank data disk (`runtime_dir/<cvm id>/data.raw`), which persists
  across stop/start and updates, as the clouds' separate data disks do. An update (new SSH keys)
  is a new launch: the VM is stopped and booted again with the new launch data (the clouds
  replace the VM). Stop is the ACPI power button (GCP: TERMINATED; Azure: the VM removed), start
  boots it again from the same disks (Azure: a new goal-state incarnation).
- The running VMs and their stand-ins live in the Console process (`resumable = False`): after a
  Console restart a VM it launched is unknown here (refused, said so), and its QEMU is gone with
  the process. Emulation, not a cloud: nothing of it is durable but the data disk.
- The enrollment token is held in the stand-in's memory only (no file, no provider state).
- The Dev workload's network (`forwards`): the guest reaches exactly the Console's and its
  Security CVM's addresses (launch data's `console_ips`, `security_cvm_ips`, inside QEMU's
  168.0.0.0/6), each relayed to a loopback port of this host; the attested SSH ingress is
  published on a loopback port of its own (chosen at launch, kept across stop/start), recorded
  with the Dev release (`release_manifest`) and the launch data's expected events in
  `provider_state` for `umbra ssh`, which checks all of it against the CVM's quote.
- Each VM has the host's simulated TDX module (umbra.emulated.tdx_module) on its port, signing
  with `simulated_pki` (the PKI whose root the Console's `release_simulated_root` trusts for a
  `tee: simulated` Dev release): the image's `--tee emulated` agent measures into it and its
  services quote from it. Each boot is a fresh TD.
"""

from __future__ import annotations

import shutil
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from umbra.attest.errors import AttestError
from umbra.attest.measurement import load_release_manifest
from umbra.attest.simpki import SimulatedPki
from umbra.components.launch_data import LaunchData
from umbra.console.enums import CvmKind
from umbra.console.providers import (
    CvmSpec,
    OnProviderEvent,
    ProviderError,
    ProviderEvent,
    ProviderUnsupported,
    Provisioned,
)
from umbra.console.session_info import EVENTS_KEY, INGRESS_KEY, RELEASE_KEY
from umbra.contracts.model import Strict
from umbra.contracts.validation import first_problem
from umbra.emulated.metadata import EmulatedMetadata, Shape
from umbra.emulated.qemu import (
    OVMF,
    Firmware,
    Forward,
    QemuVm,
    VmConfig,
    VmError,
    check_forward,
    create_data_disk,
)
from umbra.emulated.tdx_module import TdxModule


class QemuForward(Strict):
    """A guest destination `address:port` relayed to 127.0.0.1:`host_port` (emulated.qemu)."""

    address: str
    port: int = Field(ge=1, le=65535)
    host_port: int = Field(ge=1, le=65535)


class QemuCvmSettings(Strict):
    shape: Shape
    # The packed `qemu` OS image (`umbra image disks … --out DIR`: DIR/disk.raw), never written.
    disk: Path
    # The Dev release's app-compose.json (`umbra image measure --out`): the launch data's compose.
    app_compose: Path
    runtime_dir: Path
    firmware_code: Path = OVMF
    # A variable store with the release certificate enrolled (images.secure_boot.ovmf_vars):
    # Secure Boot on, `firmware_code` then OVMF's Secure Boot build. None: Secure Boot off.
    firmware_vars: Path | None = None
    memory_mb: int = Field(default=1024, ge=512, le=16384)
    accel: Literal["tcg", "kvm"] = "tcg"
    data_disk_gb: int = Field(default=4, ge=1, le=256)
    console_url: str | None = None
    console_ca: Path | None = None
    # The simulated PKI directory (`umbra attest simulate`'s) the VMs' TDX modules sign with, and
    # the simulated image name whose boot values their RTMR0-2 hold (the Dev release's).
    simulated_pki: Path
    tee_image: str = "umbra-dev-cvm"
    # The Dev workload's addresses (launch data) and the forwards that make them reachable.
    console_ips: list[str] = Field(default_factory=list)
    security_cvm_ips: list[str] = Field(default_factory=list)
    forwards: list[QemuForward] = Field(default_factory=list)
    # The Dev release's manifest (the Console's `dev_cvm_release_policy`): with it, each VM's
    # attested SSH ingress is published on a loopback port and recorded for `umbra ssh`.
    release_manifest: Path | None = None


def load_settings(path: Path) -> QemuCvmSettings:
    try:
        return QemuCvmSettings.model_validate_json(path.read_text())
    except OSError as exc:
        raise ProviderError(f"qemu_cvm_config {path}: {exc.strerror}") from None
    except ValidationError as exc:
        raise ProviderError(f"qemu_cvm_config {path}: {first_problem(exc)}") from None


@dataclass
class _Vm:
    stand_in: EmulatedMetadata
    module: TdxModule
    dir: Path
    data: LaunchData
    ssh_port: int | None = None  # the ingress's loopback port (hostfwd), kept across boots
    boot: int = 0
    qemu: QemuVm | None = None


class QemuCvmProvider:
    name = "qemu"
    background = True  # a boot is started, not awaited; the worker records the outcome
    resumable = False  # the VMs live in this process (module docstring)

    def __init__(self, settings: QemuCvmSettings, vm_factory: type[QemuVm] | None = None) -> None:
        self.settings = settings
        try:
            self._pki = SimulatedPki.load(settings.simulated_pki)
        except (OSError, AttestError, ValueError) as exc:
            raise ProviderError(
                f"qemu provider: simulated_pki {settings.simulated_pki}: {exc}"
            ) from None
        self._release: dict[str, Any] | None = None
        try:
            for forward in settings.forwards:
                check_forward(Forward(forward.address, forward.port, forward.host_port))
            if settings.release_manifest is not None:
                self._release = load_release_manifest(settings.release_manifest).model_dump(
                    mode="json", exclude_none=True
                )
        except VmError as exc:
            raise ProviderError(f"qemu provider: {exc}") from None
        except (OSError, AttestError, ValueError) as exc:
            raise ProviderError(
                f"qemu provider: release_manifest {settings.release_manifest}: {exc}"
            ) from None
        self._factory = vm_factory or QemuVm
        self._vms: dict[str, _Vm] = {}
        self._lock = threading.Lock()
        self.default_data_disk_gb: int | None = settings.data_disk_gb

    # ---- the Protocol -----------------------------------------------------------------------

    def check(self, spec: CvmSpec) -> None:
        if spec.kind != CvmKind.dev:
            raise ProviderUnsupported(
                "the qemu provider launches Dev CVMs; the emulated cloud's Security CVM is "
                "not launched through the Console"
            )
        if not spec.ssh_keys:
            raise ProviderError(f"{spec.id}: a Dev CVM needs at least one SSH key")
        for what, path in (
            ("disk", self.settings.disk),
            ("app_compose", self.settings.app_compose),
        ):
            if not path.is_file():
                raise ProviderError(f"qemu provider: {what} {path} does not exist")

    def launch_data(self, spec: CvmSpec) -> LaunchData:
        """What the stacks' DevCvm component renders for this CVM (components.cvm), here."""
        s = self.settings
        try:
            app_compose = s.app_compose.read_text()
            ca = s.console_ca.read_text() if s.console_ca is not None else None
        except OSError as exc:
            raise ProviderError(f"qemu provider: {exc.filename}: {exc.strerror}") from None
        return LaunchData(
            role="dev-cvm",
            team=spec.team,
            cvm_id=spec.id,
            app_compose=app_compose,
            ssh_authorized_keys=tuple(spec.ssh_keys),
            console_url=s.console_url,
            console_ca=ca,
            console_ips=tuple(s.console_ips),
            security_cvm_ips=tuple(s.security_cvm_ips),
            enrollment_token=spec.enrollment_token,
            cloud=s.shape,
        )

    def launch(self, spec: CvmSpec, on_event: OnProviderEvent) -> Provisioned:
        self.check(spec)
        data = self.launch_data(spec)
        d = self.settings.runtime_dir / spec.id
        try:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            create_data_disk(d / "data.raw", spec.data_disk_gb or self.settings.data_disk_gb)
        except OSError as exc:
            raise ProviderError(f"qemu CVM {spec.id}: {exc.strerror}") from None
        module = TdxModule(d / "tdx.sock", self._pki, self.settings.tee_image).start()
        vm = _Vm(EmulatedMetadata(self.settings.shape, data, spec.id).start(), module, d, data)
        if self._release is not None:
            vm.ssh_port = _free_port()
        with self._lock:
            self._vms[spec.id] = vm
        self._boot(spec.id, vm, on_event)
        return Provisioned(self.ref(spec.id), self._state(vm))

    def update(self, spec: CvmSpec, ref: str, on_event: OnProviderEvent) -> Provisioned:
        vm = self._vm(ref)
        vm.data = self.launch_data(spec)
        vm.stand_in.set_launch(vm.data)
        self._halt(vm)
        try:  # a resize grows the kept disk (the guest grows its filesystem at boot)
            create_data_disk(vm.dir / "data.raw", spec.data_disk_gb or self.settings.data_disk_gb)
        except OSError as exc:
            raise ProviderError(f"qemu CVM {spec.id}: {exc.strerror}") from None
        vm.stand_in.restart()
        self._boot(spec.id, vm, on_event)
        return Provisioned(ref, self._state(vm))

    def set_running(self, ref: str, running: bool) -> None:
        vm = self._vm(ref)
        if not running:
            self._halt(vm)
        elif vm.qemu is None or not vm.qemu.running():
            vm.stand_in.restart()
            self._boot(ref.removeprefix("qemu:"), vm, lambda _e: None)

    def destroy(self, spec: CvmSpec, ref: str | None, on_event: OnProviderEvent) -> None:
        with self._lock:
            vm = self._vms.pop(spec.id, None)
        if vm is not None:
            if vm.qemu is not None:
                vm.qemu.kill()
            vm.stand_in.stop()
            vm.module.close()
        shutil.rmtree(self.settings.runtime_dir / spec.id, ignore_errors=True)
        on_event(ProviderEvent("destroyed", f"qemu VM {spec.id} and its data disk removed"))

    # ---- helpers ----------------------------------------------------------------------------

    @staticmethod
    def ref(cvm_id: str) -> str:
        return f"qemu:{cvm_id}"

    def config(self, cvm_id: str, vm: _Vm) -> VmConfig:
        s = self.settings
        firmware = Firmware(s.firmware_code)
        if s.firmware_vars is not None:
            own = vm.dir / "vars.fd"  # the firmware writes its store: the VM's own copy
            if not own.exists():
                shutil.copyfile(s.firmware_vars, own)
            firmware = Firmware(s.firmware_code, own)
        return VmConfig(
            shape=s.shape,
            disk=s.disk,
            data_disk=vm.dir / "data.raw",
            serial=vm.dir / f"serial-{vm.boot}.log",
            qmp=vm.dir / "qmp.sock",
            metadata_port=vm.stand_in.metadata_port,
            wire_port=vm.stand_in.wire_port,
            firmware=firmware,
            memory_mb=s.memory_mb,
            accel=s.accel,
            tdx_module=vm.module.socket_path,
            forwards=tuple(Forward(f.address, f.port, f.host_port) for f in s.forwards),
            ssh_host_port=vm.ssh_port,
        )

    def _boot(self, cvm_id: str, vm: _Vm, on_event: OnProviderEvent) -> None:
        vm.boot += 1
        try:
            vm.qemu = self._factory(self.config(cvm_id, vm)).start()
        except (VmError, OSError) as exc:
            raise ProviderError(f"qemu CVM {cvm_id}: {exc}") from None
        serial = vm.dir / f"serial-{vm.boot}.log"
        shape = self.settings.shape
        on_event(ProviderEvent("booting", f"{shape} shape, boot {vm.boot}, serial {serial}"))

    @staticmethod
    def _halt(vm: _Vm) -> None:
        if vm.qemu is not None:
            vm.qemu.stop()

    def _vm(self, ref: str) -> _Vm:
        with self._lock:
            vm = self._vms.get(ref.removeprefix("qemu:"))
        if not ref.startswith("qemu:") or vm is None:
            raise ProviderError(
                f"qemu provider knows no VM {ref!r} in this Console process (the emulated "
                "cloud's VMs end with the Console that launched them)"
            )
        return vm

    def _state(self, vm: _Vm) -> dict[str, Any]:
        """`provider_state`: where to look (no launch data: the token must not be stored), and
        what `umbra ssh` needs (checked by it against the quote, never trusted on its own)."""
        state: dict[str, Any] = {
            "runtime": "qemu",
            "shape": str(self.settings.shape),
            "boot": vm.boot,
            "serial": str(vm.dir / f"serial-{vm.boot}.log"),
            "data_disk": str(vm.dir / "data.raw"),
        }
        if vm.ssh_port is not None and self._release is not None:
            state[INGRESS_KEY] = {"host": "127.0.0.1", "port": vm.ssh_port}
            state[RELEASE_KEY] = self._release
            state[EVENTS_KEY] = vm.data.expected_events()
        return state


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
