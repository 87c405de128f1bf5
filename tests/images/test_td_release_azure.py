"""`umbra image measure --cloud azure`: a signed `platform: azure-tdx` release whose image PCRs
(4, 5, 9, 11, 12, SHA-256) are computed from the built UKI and disk with td_boot's events (the
ones the swtpm boot validated), the paravisor's MRTD and the firmware's PCRs from the firmware
inputs; simulated Azure evidence (HCL report + vTPM quote) whose PCRs are the computed ones
verifies under it, and is refused under the release of a UKI with one byte changed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from umbra.attest.collateral import StaticCollateral
from umbra.attest.eventlog import EV_SEPARATOR, replay
from umbra.attest.measurement import MeasurementPolicy, ReleaseManifest
from umbra.attest.simazure import SimulatedAzureCvm, simulated_pcrs
from umbra.attest.simpki import SimulatedPki
from umbra.attest.verify import Step, Verifier
from umbra.cli.app import app
from umbra.images.definition import DefinitionError, parse_definition
from umbra.images.measure import measure
from umbra.images.pe import sections
from umbra.images.td_boot import (
    TPM_PCRS,
    Measured,
    golden_pcrs,
    golden_rtmrs,
    rtmr_of_pcr,
    td_events,
)
from umbra.images.td_release import FIRMWARE_PCRS

from .tcg2_log import LoggedEvent, replay_pcrs
from .test_td_boot import fake_disk, uki
from .test_td_release import SECURITY, _disks

runner = CliRunner()
BINDING = bytes(range(64))
__all__ = ["uki"]  # the small-UKI fixture, shared with test_td_boot


@pytest.fixture(scope="module")
def pki() -> SimulatedPki:
    return SimulatedPki.generate()


def _firmware(path: Path, cvm: SimulatedAzureCvm, pcrs: dict[int, Any] | None = None) -> Path:
    """Azure's inputs as the release owner pins them: the paravisor's MRTD and the firmware's
    PCRs (here the simulated CVM's own, as published values would be a real one's)."""
    azure = {
        "mrtd": [cvm.tdx.mr_td.hex()],
        "pcrs": pcrs if pcrs is not None else {i: [cvm.pcrs[i].hex()] for i in FIRMWARE_PCRS},
        "source": "the test's simulated paravisor and firmware",
    }
    doc = {"apiVersion": "umbra/v1", "kind": "TdFirmware", "clouds": {"azure": azure}}
    path.write_text(yaml.safe_dump(doc))
    return path


def _tpm_log(measured: tuple[Measured, ...]) -> list[LoggedEvent]:
    return [LoggedEvent(m.pcr, m.event_type, {"sha256": m.sha256}, m.event_data) for m in measured]


@pytest.mark.parametrize("returned", [0, 1], ids=["cloud", "as-the-swtpm-boot"])
def test_computed_pcrs_are_the_replay_the_swtpm_boot_validated(
    uki: Path, tmp_path: Path, returned: int
) -> None:
    disk = fake_disk(tmp_path / "disk.raw")
    tpm = golden_pcrs(uki, disk, returned_attempts=returned)
    assert sorted(tpm.pcrs) == sorted(TPM_PCRS)
    # golden_pcrs' events are what test_td_boot_swtpm compares with the real TCG2 log, and this
    # is that test's replay of a log (tcg2_log.replay_pcrs): the same PCR values. 12 is never
    # extended by our boot (the real TPM held zero there).
    replayed = replay_pcrs(_tpm_log(tpm.measured), "sha256")
    assert {**dict.fromkeys(TPM_PCRS, bytes(32)), **replayed} == tpm.pcrs
    assert tpm.pcrs[12] == bytes(32) and 12 not in replayed
    # The same events as the TD's RTMR1/RTMR2 (one separator each on PCR 4 and 5, where a TD
    # draws one): one computation for both clouds, not two.
    td = golden_rtmrs(uki, disk, returned_attempts=returned)
    separators = [m for m in tpm.measured if m.event_type == EV_SEPARATOR]
    assert [m.pcr for m in separators] == [4, 5]
    folded = [m for m in tpm.measured if m is not separators[1]]
    assert folded == list(td.measured)
    assert replay(td_events(folded))[1:3] == (td.rtmr1, td.rtmr2)
    assert {rtmr_of_pcr(p) for p in tpm.pcrs} == {1, 2}


def _release(tmp_path: Path, efi: Path, disk: Path, fw: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    r = runner.invoke(app, ["image", "measure", str(SECURITY), "--boot", str(_disks(tmp_path, efi, disk)),
                            "--cloud", "azure", "--firmware", str(fw), "--out", str(out), *extra])  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def test_azure_release_pins_the_computed_pcrs_and_verifies_only_matching_evidence(
    uki: Path, tmp_path: Path, pki: SimulatedPki
) -> None:
    disk = fake_disk(tmp_path / "disk.raw")
    firmware_cvm = SimulatedAzureCvm(pki)
    fw = _firmware(tmp_path / "firmware.yaml", firmware_cvm)
    key = tmp_path / "release.key"
    assert runner.invoke(app, ["image", "keygen", str(key)]).exit_code == 0
    out = _release(tmp_path, uki, disk, fw, "right", "--sign-key", str(key))
    computed = golden_pcrs(uki, disk).pcrs
    doc = yaml.safe_load((out / "release.yaml").read_text())
    assert doc["tee"] == "tdx" and doc["platform"] == "azure-tdx"
    assert doc["mrtd"] == [firmware_cvm.tdx.mr_td.hex()]
    assert not {"rtmr0", "rtmr1", "rtmr2"} & set(doc) and doc["events"] == []
    pinned = ReleaseManifest.model_validate(doc).pcrs or {}
    assert sorted(pinned) == sorted((*FIRMWARE_PCRS, *TPM_PCRS))
    for i in TPM_PCRS:
        assert pinned[i] == [computed[i].hex()]
    for i in FIRMWARE_PCRS:
        assert pinned[i] == [firmware_cvm.pcrs[i].hex()]
    events = json.loads((out / "td-boot-events.json").read_text())
    assert [e["digest"] for e in events] == [
        m.sha256.hex() for m in golden_pcrs(uki, disk).measured
    ]
    signed = out / "measurement-manifest.signed.json"
    ok = runner.invoke(app, ["image", "verify-manifest", str(signed), "-k", f"{key}.pub"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(signed.read_text())["manifest"]["rtmr3_events"] == []

    changed = tmp_path / "changed.efi"
    data = bytearray(uki.read_bytes())
    data[next(s for s in sections(bytes(data)) if s.name == ".linux").raw_ptr + 99] ^= 1
    changed.write_bytes(bytes(data))
    wrong_doc = yaml.safe_load(
        (_release(tmp_path, changed, disk, fw, "wrong") / "release.yaml").read_text()
    )
    differ = sorted(int(i) for i in doc["pcrs"] if doc["pcrs"][i] != wrong_doc["pcrs"][i])
    assert differ == [4, 11]  # the UKI's Authenticode hash and systemd-stub's .linux

    # An Azure CVM whose vTPM holds the firmware's PCRs and the computed image PCRs.
    booted = {**{i: firmware_cvm.pcrs[i] for i in FIRMWARE_PCRS}, **computed}
    cvm = SimulatedAzureCvm(pki, ak=firmware_cvm.ak, pcrs=booted)
    evidence = cvm.source().get_quote(BINDING)
    collateral = StaticCollateral(pki.collateral(int(time.time()) - 60))
    for release_doc, accepted in ((doc, True), (wrong_doc, False)):
        # Simulated PKI quotes: the same values, verified under its root.
        release = ReleaseManifest.model_validate({**release_doc, "tee": "simulated"})
        verdict = Verifier(
            MeasurementPolicy(release=release), collateral, True, pki.root_der
        ).verify(evidence, expected_report_data=BINDING)
        assert verdict.ok is accepted, verdict.reasons
        if not accepted:
            assert verdict.failed_steps == [Step.MEASUREMENT]
            assert [r.split()[0] for r in verdict.reasons] == ["PCR4", "PCR11"], verdict.reasons
    # The simulator's stand-in PCRs are not the computed ones.
    assert simulated_pcrs(cvm.image)[11] != computed[11]


@pytest.mark.parametrize(
    ("pcrs", "says"),
    [
        ("no-azure", "clouds.azure: missing: the paravisor's MRTD and the firmware's PCRs 0, 1, 2, 3, 6, 7"),
        ("drop-7", "pcrs 7: missing: the firmware's PCRs 0, 1, 2, 3, 6, 7 are inputs"),
        ("pin-4", "pcrs 4: computed from the image's UKI and disk, never a firmware input"),
    ],
)  # fmt: skip
def test_a_missing_or_overreaching_azure_firmware_input_writes_nothing(
    uki: Path, tmp_path: Path, pki: SimulatedPki, pcrs: str, says: str
) -> None:
    cvm = SimulatedAzureCvm(pki)
    fw = tmp_path / "firmware.yaml"
    given = {i: [cvm.pcrs[i].hex()] for i in FIRMWARE_PCRS}
    if pcrs == "no-azure":
        gcp = {"mrtd": ["11" * 48], "rtmr0": ["22" * 48], "source": "x"}
        fw.write_text(yaml.safe_dump({"apiVersion": "umbra/v1", "kind": "TdFirmware",
                                      "clouds": {"gcp": gcp}}))  # fmt: skip
    elif pcrs == "drop-7":
        _firmware(fw, cvm, {i: v for i, v in given.items() if i != 7})
    else:
        _firmware(fw, cvm, {**given, 4: ["00" * 32]})
    out = tmp_path / "out"
    boot = _disks(tmp_path, uki, fake_disk(tmp_path / "disk.raw"))
    r = runner.invoke(app, ["image", "measure", str(SECURITY), "--boot", str(boot), "--cloud", "azure",
                            "--firmware", str(fw), "--out", str(out)])  # fmt: skip
    assert r.exit_code == 2, r.output
    assert says in " ".join(r.output.split()), r.output
    assert str(fw) in r.output and not out.exists()


def test_an_azure_definition_pins_mrtd_and_pcrs_never_rtmrs() -> None:
    doc = yaml.safe_load(SECURITY.read_text())
    pcrs = {i: ["00" * 32] for i in (*FIRMWARE_PCRS, *TPM_PCRS)}
    base = {"platform": "azure-tdx", "mrtd": ["11" * 48], "pcrs": pcrs}
    ok = parse_definition({**doc, "tee": "tdx", "base": base})
    release = measure(ok).release
    assert release.platform == "azure-tdx" and release.events == [] and release.rtmr1 is None
    for extra, says in (
        ({"rtmr1": ["22" * 48]}, "RTMRs are zero"),
        ({"pcrs": None}, "needs mrtd and pcrs"),
    ):
        bad = {k: v for k, v in {**base, **extra}.items() if v is not None}
        with pytest.raises(DefinitionError, match=says):
            parse_definition({**doc, "tee": "tdx", "base": bad})
    simulated = {**doc["base"], "platform": "azure-tdx"}
    with pytest.raises(DefinitionError, match="platform tdx only"):
        parse_definition({**doc, "base": simulated})
    with pytest.raises(DefinitionError, match="only on platform azure-tdx"):
        parse_definition({**doc, "tee": "tdx", "base": {**base, "platform": "tdx"}})
