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

import base64
import hashlib
import os
import re
import time
from pathlib import Path

import pytest

from umbra.attest.collateral import StaticCollateral
from umbra.attest.eventlog import load_event_log
from umbra.attest.measurement import MeasurementPolicy
from umbra.attest.quote import parse_quote
from umbra.attest.simpki import SimulatedPki
from umbra.attest.verify import Verifier
from umbra.components.launch_data import LaunchData
from umbra.emulated.metadata import EmulatedMetadata, Shape
from umbra.emulated.qemu import SMBIOS, QemuVm, VmConfig, create_data_disk
from umbra.emulated.tdx_module import TdxModule
from umbra.images.disk_formats import CloudDisks
from umbra.images.measure import measure
from umbra.images.uki import Uki

from ..sandbox.fixtures import dev_definition
from .test_qemu_boot import KEY, NONCE, _need_qemu, started_file

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
    m = measure(dev_definition())
    data = LaunchData(
        role="dev-cvm",
        team="team-a",
        cvm_id=f"cvm_emulated_{shape}",
        app_compose=m.app_compose.decode(),
        ssh_authorized_keys=(KEY,),
        cloud=shape,
    )
    pki = SimulatedPki.generate()
    verifier = Verifier(
        MeasurementPolicy(release=m.release, binding=m.binding(data.cvm_id, [KEY])),
        StaticCollateral(pki.collateral(int(time.time()) - 60)),
        allow_simulated=True,
        simulated_root_der=pki.root_der,
    )
    rtmr3s: list[bytes] = []
    compose = started_file(data)
    vendor = SMBIOS[shape][0]
    data_disk = tmp_path / "data.raw"
    create_data_disk(data_disk, 1)
    module = TdxModule(tmp_path / "tdx.sock", pki, "umbra-dev-cvm")
    with module.serving(), EmulatedMetadata(shape, data, f"vm-{shape}").serving() as stand_in:
        for boot in (1, 2):
            config = VmConfig(
                shape, disks.raw, data_disk, tmp_path / f"serial-{boot}.log",
                tmp_path / "qmp.sock", stand_in.metadata_port, stand_in.wire_port,
                accel=ACCEL, tdx_module=module.socket_path,
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
                rtmr3s.append(_guest_quote_verifies(verifier, text, boot))
                start = time.monotonic()
                assert vm.stop(300), f"boot {boot}: the guest ignored the ACPI power button"
                print(f"{shape} boot {boot}: stop {time.monotonic() - start:.0f} s")
            finally:
                vm.kill()
            stand_in.restart()
    # Each boot is a fresh TD: RTMR3 from zero, with this boot's id and host key in it.
    assert len(module.boots) == 2 and rtmr3s[0] != rtmr3s[1]
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


def _guest_quote_verifies(verifier: Verifier, text: str, boot: int) -> bytes:
    """The quote the guest took from the host's TDX module (the stub's), with the event log the
    agent wrote for its services: accepted for the release and this instance's binding, over
    the stub's report data. Returns the quoted RTMR3."""
    quote = re.search(r"umbra-compose-stub: quote (\S*)", text)
    log = re.search(r"umbra-compose-stub: event-log (\S*)", text)
    assert quote is not None and log is not None, text[-3000:]
    try:
        raw = base64.b64decode(quote[1], validate=True)
    except ValueError:
        raise AssertionError(f"boot {boot}: no quote in the guest: {quote[1][:500]}") from None
    events = load_event_log(base64.b64decode(log[1]))
    verdict = verifier.verify(raw, event_log=events, expected_report_data=NONCE)
    assert verdict.ok, (boot, verdict.reasons)
    assert any(e.name == "umbra.boot-id" for e in events)
    return parse_quote(raw).td_report.rtmrs[3]
