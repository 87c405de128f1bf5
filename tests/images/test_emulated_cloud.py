"""The built `qemu` OS image on the emulated clouds (umbra.emulated), once per cloud shape: booted
under QEMU + OVMF (TCG) as GCP or Azure would boot it (the cloud's SMBIOS, its metadata address,
Azure's wire server), launch data from the metadata stand-in rendered by the components' own code
(`LaunchData.gcp_metadata()` / `azure_user_data()`), through the launch agent's ready report,
then stopped (ACPI power button, as a cloud stop does) and started again from the same disks: the
second boot re-reads its launch data, finds its data disk by label with the first boot's
workspace on it, and reports ready for the new boot (Azure: a new goal-state incarnation).

Each shape is one test of two boots (~2-6 min each under TCG on the 2-core CI runner); the
image is the boot tests' session build (tests/images/conftest.py). Run under
`flock /tmp/umbra-heavy.lock` locally.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from umbra.components.launch_data import LaunchData
from umbra.emulated.metadata import EmulatedMetadata, Shape
from umbra.emulated.qemu import SMBIOS, QemuVm, VmConfig, create_data_disk
from umbra.images.disk_formats import CloudDisks
from umbra.images.measure import measure
from umbra.images.uki import Uki

from ..sandbox.fixtures import dev_definition
from .test_qemu_boot import KEY, _need_qemu, started_file

pytestmark = pytest.mark.timeout(2400)
BOOT_LIMIT = 900.0
# TCG by default (what CI is known to have); UMBRA_TEST_ACCEL=kvm where KVM works.
ACCEL = os.environ.get("UMBRA_TEST_ACCEL", "tcg")


@pytest.mark.parametrize("shape", [Shape.gcp, Shape.azure])
def test_the_image_boots_as_the_cloud_reports_ready_and_survives_stop_and_start(
    shape: Shape, qemu_disks: tuple[Uki, CloudDisks], tmp_path: Path
) -> None:
    _need_qemu()
    _uki, disks = qemu_disks
    data = LaunchData(
        role="dev-cvm",
        team="team-a",
        cvm_id=f"cvm_emulated_{shape}",
        app_compose=measure(dev_definition()).app_compose.decode(),
        ssh_authorized_keys=(KEY,),
        cloud=shape,
    )
    compose = started_file(data)
    vendor = SMBIOS[shape][0]
    data_disk = tmp_path / "data.raw"
    create_data_disk(data_disk, 1)
    with EmulatedMetadata(shape, data, f"vm-{shape}").serving() as stand_in:
        for boot in (1, 2):
            config = VmConfig(
                shape, disks.raw, data_disk, tmp_path / f"serial-{boot}.log",
                tmp_path / "qmp.sock", stand_in.metadata_port, stand_in.wire_port,
                accel=ACCEL,
            )  # fmt: skip
            start = time.monotonic()
            vm = QemuVm(config).start()
            try:
                report = None
                while report is None and vm.running() and time.monotonic() - start < BOOT_LIMIT:
                    report = stand_in.wait_ready(boot, 5)
                took = time.monotonic() - start
                text = vm.serial_text()
                assert report is not None, (
                    f"boot {boot}: no ready report ({vm.stderr()}):\n{text[-3000:]}"
                )
                print(f"{shape} boot {boot}: launch to ready report {took:.0f} s")
                # The agent took this cloud's path (SMBIOS), started the compose it was given.
                assert f"umbra-compose-stub: up {hashlib.sha256(compose).hexdigest()}" in text
                assert (
                    f"umbra-launch: dev-cvm {data.cvm_id} started, compose-hash "
                    f"{data.compose_sha256}" in text
                )
                if shape is Shape.gcp:
                    assert report.detail == data.compose_sha256
                else:
                    assert report.detail.startswith(f"{boot}/")
                # The data disk: blank at launch (formatted), found again by label after the
                # stop, with the first boot's workspace file on it.
                assert f"umbra-compose-stub: data /dev/vdb ext4 boots {boot} cloud {vendor}" in text
                found = "formatted (it was empty) and mounted" if boot == 1 else "mounted at"
                assert f"umbra-launch: data disk /dev/vdb {found}" in text, text[-3000:]
                # Idle stop is installed in the image and armed on a Dev CVM.
                assert "umbra-launch: idle auto-stop armed (60 min)" in text
                start = time.monotonic()
                assert vm.stop(300), f"boot {boot}: the guest ignored the ACPI power button"
                print(f"{shape} boot {boot}: stop {time.monotonic() - start:.0f} s")
            finally:
                vm.kill()
            stand_in.restart()
    requests = stand_in.requests
    if shape is Shape.gcp:
        want = "metadata GET /computeMetadata/v1/instance/attributes/?recursive=true"
        assert requests.count(want) == 2
        assert (
            requests.count("metadata PUT /computeMetadata/v1/instance/guest-attributes/umbra/ready")
            == 2
        )
    else:
        assert (
            sum(r.startswith("metadata GET /metadata/instance/compute/userData") for r in requests)
            == 2
        )
        assert requests.count("wire POST /machine/?comp=health") == 2
