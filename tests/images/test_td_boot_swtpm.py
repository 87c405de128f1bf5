"""images.td_boot against a real firmware log: the signed disk booted under OVMF's Secure Boot
build (TCG) with a software TPM (swtpm), as the emulated GCP boots it. The compose stub prints
the TCG2 event log Linux kept (/sys/kernel/security/tpm0/binary_bios_measurements: the
firmware's, systemd-stub's and the kernel EFI stub's events) and the PCRs. The computed
measurements must be exactly the log's events on the PCRs the UKI's events go to (4, 5, 9, 11,
12), digest for digest in the SHA-256 and SHA-384 banks, and their replay the PCRs the TPM
holds: the same events TDVF extends into RTMR1 (PCR 4/5) and RTMR2 (PCR 9/11).
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from umbra.attest.eventlog import EV_SEPARATOR, Event, replay
from umbra.emulated.metadata import EmulatedMetadata
from umbra.emulated.qemu import Firmware, VmConfig, create_data_disk, qemu_argv
from umbra.images.disk_formats import CloudDisks
from umbra.images.secure_boot import OVMF_SECBOOT_CODE
from umbra.images.td_boot import (
    EV_EFI_BOOT_SERVICES_APPLICATION,
    TPM_PCRS,
    golden_pcrs,
    golden_rtmrs,
    rtmr_of_pcr,
)
from umbra.images.uki import Uki

from .tcg2_log import EV_NO_ACTION, LoggedEvent, parse_tcg2_log, replay_pcrs
from .test_qemu_boot import (
    TDX_SOCKET,
    _need_qemu,
    _vars,
    _watch,
    metadata,
    secure_vars_template,
)

__all__ = ["metadata", "secure_vars_template"]  # fixtures, shared with test_qemu_boot
UKI_PCRS = TPM_PCRS
pytestmark = pytest.mark.timeout(1500)


def _swtpm(state: Path) -> tuple[subprocess.Popen[bytes], Path]:
    if shutil.which("swtpm") is None:
        pytest.skip("needs swtpm (scripts/system-deps installs it)")
    sock = state / "swtpm.sock"
    proc = subprocess.Popen(
        ["swtpm", "socket", "--tpm2", "--tpmstate", f"dir={state}",
         "--ctrl", f"type=unixio,path={sock}", "--log", f"file={state / 'swtpm.log'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(100):
        if sock.exists():
            break
        time.sleep(0.1)
    return proc, sock


def _logged(events: list[LoggedEvent]) -> list[tuple[int, int, bytes, bytes]]:
    return [
        (e.pcr, e.event_type, e.digests["sha256"], e.digests["sha384"])
        for e in events
        if e.pcr in UKI_PCRS and e.event_type != EV_NO_ACTION
    ]


def test_the_computed_boot_events_are_the_firmware_logs_and_replay_to_its_pcrs(
    qemu_disks: tuple[Uki, CloudDisks],
    secure_vars_template: Path,
    metadata: EmulatedMetadata,
    tmp_path: Path,
) -> None:
    _need_qemu()
    uki, disks = qemu_disks
    state = tmp_path / "tpm"
    state.mkdir()
    swtpm, sock = _swtpm(state)
    serial = tmp_path / "serial.log"
    data_disk = tmp_path / "data.raw"
    create_data_disk(data_disk, 1)
    vm = qemu_argv(
        VmConfig(
            metadata.shape, disks.raw, data_disk, serial, tmp_path / "qmp.sock",
            metadata.metadata_port, metadata.wire_port,
            Firmware(OVMF_SECBOOT_CODE, _vars(secure_vars_template, tmp_path)),
            tdx_module=tmp_path / TDX_SOCKET,
        )
    )  # fmt: skip
    tpm = ["-chardev", f"socket,id=chrtpm,path={sock}",
           "-tpmdev", "emulator,id=tpm0,chardev=chrtpm", "-device", "tpm-crb,tpmdev=tpm0"]  # fmt: skip
    argv = [*vm, *tpm]
    qemu = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        text = _watch(qemu, serial, re.compile(r"umbra-compose-stub: tpm-pcrs .*\n"), 1200)
    finally:
        qemu.kill()
        qemu.wait(30)
        swtpm.kill()
        swtpm.wait(30)
    found = re.search(r"umbra-compose-stub: tpm-log (\S+)", text)
    pcrs = re.search(r"umbra-compose-stub: tpm-pcrs (.*)", text)
    assert found and pcrs, f"no TPM log on the serial console; tail:\n{text[-3000:]}"
    blob = base64.b64decode(found[1])
    (tmp_path / "binary_bios_measurements").write_bytes(blob)
    log = parse_tcg2_log(blob)
    # QEMU's q35 has an empty DVD-ROM drive whose boot option OVMF tries first and returns
    # from: the one returned attempt in this log (a cloud VM has no such drive).
    assert len(re.findall(r"BdsDxe: failed to load Boot", text)) == 1
    assert 'failed to load Boot0001 "UEFI QEMU DVD-ROM' in text
    # The TD's one separator into RTMR1 is, on a TPM, one on PCR 4 and one on PCR 5: the
    # events and PCRs a platform: azure-tdx release is computed from (td_boot.golden_pcrs).
    expected = golden_pcrs(uki.path, disks.raw, returned_attempts=1)
    assert _logged(log) == [(m.pcr, m.event_type, m.sha256, m.sha384) for m in expected.measured]
    # The PCRs the TPM holds are the computed events' replay (nothing else extended them);
    # systemd-stub measured no command line of the loader's (PCR 12 stays zero).
    held = {int(i): bytes.fromhex(v) for i, v in re.findall(r"(\d+)=([0-9a-fA-F]{64})", pcrs[1])}
    assert sorted(expected.pcrs) == sorted(UKI_PCRS) and expected.pcrs[12] == bytes(32)
    for index, value in expected.pcrs.items():
        assert held[index] == value, f"PCR {index}"
    assert replay_pcrs(log, "sha256")[4] == held[4]
    # As a TD logs them (PCR 4/5 → RTMR1, 9/11 → RTMR2, one separator on RTMR1), the real
    # events fold to the computed RTMR1 and RTMR2.
    golden = golden_rtmrs(uki.path, disks.raw, returned_attempts=1)
    td_view, separated = [], False
    for e in log:
        if e.pcr not in UKI_PCRS or e.event_type == EV_NO_ACTION:
            continue
        if e.event_type == EV_SEPARATOR:
            if separated:
                continue
            separated = True
        td_view.append(Event(rtmr_of_pcr(e.pcr), e.event_type, e.digests["sha384"], "", b"", False))
    assert replay(td_view)[1:3] == (golden.rtmr1, golden.rtmr2)
    # The UKI's own event is the Authenticode hash images.uki reports for it.
    app = [e for e in log if e.event_type == EV_EFI_BOOT_SERVICES_APPLICATION]
    assert len(app) == 1  # systemd-stub's kernel is not a second boot application
    assert app[0].digests["sha384"].hex() == uki.authenticode_sha384
