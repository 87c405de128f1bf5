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
- `forwards`: the emulated cloud network's hosts a VM reaches by address (the Console, the
  Security CVM's tunnel, its egress's origins), each relayed to a loopback port of this host
  (umbra.emulated.qemu.Forward); with `restrict=on` nothing else. A Dev CVM's host firewall
  narrows that to its launch data's `console_ips` and `security_cvm_ips`.
- A Dev CVM's attested SSH ingress is published on a loopback port of its own (chosen at launch,
  kept across stop/start), recorded with the Dev release (`release_manifest`) and the launch
  data's expected events in `provider_state` for `umbra ssh`, which checks all of it against the
  CVM's quote.
- Each VM has the host's simulated TDX module (umbra.emulated.tdx_module) on its port, signing
  with `simulated_pki` (the PKI whose root the Console's `release_simulated_root` trusts for a
  `tee: simulated` Dev release): the image's `--tee emulated` agent measures into it and its
  services quote from it. Each boot is a fresh TD.
- A **Security CVM** (`security_app_compose`: the Security release's app-compose.json, rendered
  with `simulated: {source: emulated}`) is launched like a Dev CVM, with the launch data the
  stacks render for one (role `security-cvm`, no SSH keys, the Console's URL and CA, the
  enrollment token), on `security_disk` (default `disk`: the `qemu` image carrying the
  release's image archives and Docker), its module measuring `security_tee_image`. Its tunnel
  endpoint is published on 127.0.0.1:`security_tunnel_host_port` (where the Dev CVMs'
  forwards and a host verifier's connections reach it).
"""

from __future__ import annotations

import contextlib
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
from umbra.components.ports import DEV_ATTESTED_SSH_PORT
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
    RESETS,
    Firmware,
    Forward,
    Published,
    QemuVm,
    VmConfig,
    VmError,
    check_forward,
    create_data_disk,
)
from umbra.emulated.tdx_module import TdxModule


class GuestForward(Strict):
    """A guest connection to `address:port` (inside the emulated network) relayed to
    127.0.0.1:`host_port` (umbra.emulated.qemu.Forward: checked when a VM is configured)."""

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
    # The emulated network's hosts every VM reaches by address (module docstring).
    forwards: list[GuestForward] = Field(default_factory=list)
    # A Dev CVM's launch data: the addresses its host firewall lets the forwarder reach.
    console_ips: list[str] = Field(default_factory=list)
    security_cvm_ips: list[str] = Field(default_factory=list)
    # The Dev release's manifest (the Console's `dev_cvm_release_policy`): with it, each Dev
    # VM's attested SSH ingress is published on a loopback port and recorded for `umbra ssh`.
    release_manifest: Path | None = None
    # Security CVMs (None: refused). The Security release's app-compose.json; its disk (None:
    # `disk`); the simulated image its module measures; where its tunnel port is published.
    security_app_compose: Path | None = None
    security_disk: Path | None = None
    security_tee_image: str = "umbra-security-cvm"
    # Docker, its image store and the proxy: more than a Dev CVM's stub needs.
    security_memory_mb: int = Field(default=2048, ge=512, le=16384)
    security_tunnel_port: int = Field(default=8443, ge=1, le=65535)
    security_tunnel_host_port: int | None = Field(default=None, ge=1, le=65535)


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
    kind: CvmKind
    data: LaunchData
    ssh_port: int | None = None  # a Dev VM's ingress loopback port (hostfwd), kept across boots
    boot: int = 0
    qemu: QemuVm | None = None
    # Set while the Console stops or re-creates it: the end of that boot is not a reset.
    halting: bool = False


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
        s = self.settings
        if spec.kind == CvmKind.security:
            if s.security_app_compose is None:
                raise ProviderUnsupported(
                    "this qemu provider launches Dev CVMs only (no security_app_compose in its "
                    "config)"
                )
            if spec.ssh_keys:
                raise ProviderError(f"{spec.id}: a Security CVM takes no SSH keys")
        elif spec.kind != CvmKind.dev:
            raise ProviderUnsupported(f"the qemu provider does not launch {spec.kind} CVMs")
        elif not spec.ssh_keys:
            raise ProviderError(f"{spec.id}: a Dev CVM needs at least one SSH key")
        for what, path in (
            ("disk", self._disk(spec.kind)),
            ("app_compose", self._app_compose(spec.kind)),
        ):
            if not path.is_file():
                raise ProviderError(f"qemu provider: {what} {path} does not exist")

    def _disk(self, kind: CvmKind) -> Path:
        s = self.settings
        return s.security_disk or s.disk if kind == CvmKind.security else s.disk

    def _app_compose(self, kind: CvmKind) -> Path:
        s = self.settings
        if kind == CvmKind.security and s.security_app_compose is not None:
            return s.security_app_compose
        return s.app_compose

    def launch_data(self, spec: CvmSpec) -> LaunchData:
        """What the stacks' DevCvm / SecurityCvm components render for this CVM
        (components.cvm), here."""
        s = self.settings
        try:
            app_compose = self._app_compose(spec.kind).read_text()
            ca = s.console_ca.read_text() if s.console_ca is not None else None
        except OSError as exc:
            raise ProviderError(f"qemu provider: {exc.filename}: {exc.strerror}") from None
        dev = spec.kind == CvmKind.dev
        return LaunchData(
            role="dev-cvm" if dev else "security-cvm",
            team=spec.team,
            cvm_id=spec.id,
            app_compose=app_compose,
            ssh_authorized_keys=tuple(spec.ssh_keys),
            console_url=s.console_url,
            console_ca=ca,
            console_ips=tuple(s.console_ips) if dev else (),
            security_cvm_ips=tuple(s.security_cvm_ips) if dev else (),
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
        security = spec.kind == CvmKind.security
        image = self.settings.security_tee_image if security else self.settings.tee_image
        module = TdxModule(d / "tdx.sock", self._pki, image).start()
        stand_in = EmulatedMetadata(self.settings.shape, data, spec.id).start()
        vm = _Vm(stand_in, module, d, spec.kind, data)
        if spec.kind == CvmKind.dev and self._release is not None:
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
        security = vm.kind == CvmKind.security
        return VmConfig(
            shape=s.shape,
            disk=self._disk(vm.kind),
            data_disk=vm.dir / "data.raw",
            serial=vm.dir / f"serial-{vm.boot}.log",
            qmp=vm.dir / "qmp.sock",
            metadata_port=vm.stand_in.metadata_port,
            wire_port=vm.stand_in.wire_port,
            firmware=firmware,
            memory_mb=s.security_memory_mb if security else s.memory_mb,
            accel=s.accel,
            tdx_module=vm.module.socket_path,
            forwards=tuple(Forward(f.address, f.port, f.host_port) for f in s.forwards),
            published=self._published(vm),
        )

    def _boot(
        self, cvm_id: str, vm: _Vm, on_event: OnProviderEvent, after: QemuVm | None = None
    ) -> None:
        """The next boot. `after`: only if that boot, which ended by a reset, is still the VM's
        current one (not stopped, re-created or destroyed meanwhile): decided and started under
        the lock `_halt` and `destroy` take, so a reset never revives a stopped VM."""
        with self._lock:
            if after is not None:
                if self._vms.get(cvm_id) is not vm or vm.qemu is not after or vm.halting:
                    return
                vm.stand_in.restart()
            vm.halting = False
            vm.boot += 1
            try:
                qemu = vm.qemu = self._factory(self.config(cvm_id, vm)).start()
            except (VmError, OSError) as exc:
                raise ProviderError(f"qemu CVM {cvm_id}: {exc}") from None
        threading.Thread(target=self._watch, args=(cvm_id, vm, qemu), daemon=True).start()
        serial = vm.dir / f"serial-{vm.boot}.log"
        shape = self.settings.shape
        on_event(ProviderEvent("booting", f"{shape} shape, boot {vm.boot}, serial {serial}"))

    def _watch(self, cvm_id: str, vm: _Vm, qemu: QemuVm) -> None:
        """A boot that ended by a reset (the guest's or the host's) is followed by the next one,
        a new TD on the same disks, as on GCP and Azure; a stop, a kill or a power-off is not."""
        if qemu.watch() in RESETS:
            with contextlib.suppress(ProviderError):  # the next boot's start failed: it stays off
                self._boot(cvm_id, vm, lambda _e: None, after=qemu)

    def _halt(self, vm: _Vm) -> None:
        with self._lock:
            vm.halting = True
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

    def _published(self, vm: _Vm) -> tuple[Published, ...]:
        s = self.settings
        if vm.kind == CvmKind.security and s.security_tunnel_host_port is not None:
            return (Published(s.security_tunnel_host_port, s.security_tunnel_port),)
        if vm.ssh_port is not None:
            return (Published(vm.ssh_port, DEV_ATTESTED_SSH_PORT),)
        return ()

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
        if vm.kind == CvmKind.security:
            published = self._published(vm)
            if published:
                state["tunnel"] = f"127.0.0.1:{published[0].host_port}"
        elif vm.ssh_port is not None and self._release is not None:
            state[INGRESS_KEY] = {"host": "127.0.0.1", "port": vm.ssh_port}
            state[RELEASE_KEY] = self._release
            state[EVENTS_KEY] = vm.data.expected_events()
        return state


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
