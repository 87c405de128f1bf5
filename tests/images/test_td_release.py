"""`umbra image measure --cloud … --firmware … --boot …`: a signed `tee: tdx` release whose
RTMR1/RTMR2 are computed from the built UKI and disk and whose MRTD/RTMR0 are the cloud's
firmware inputs; refused when an input is missing; and the verifier accepts a TD whose log is
the computed events only under the right values."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from umbra.attest.collateral import StaticCollateral
from umbra.attest.eventlog import Event, replay
from umbra.attest.measurement import MeasurementPolicy, ReleaseManifest
from umbra.attest.simpki import SimulatedPki
from umbra.attest.simulator import SimulatedTdx, boot_events
from umbra.attest.verify import Verifier
from umbra.cli.app import app
from umbra.images.definition import load_definition
from umbra.images.measure import CVM_ID_EVENT, measure
from umbra.images.pe import authenticode_digest, sections
from umbra.images.td_boot import golden_rtmrs
from umbra.images.td_release import FIRMWARE_PCRS

from .test_td_boot import fake_disk, uki

DEFS = Path(__file__).resolve().parents[2] / "images" / "definitions"
SECURITY = DEFS / "security-cvm.example.yaml"
runner = CliRunner()
__all__ = ["uki"]  # the small-UKI fixture, shared with test_td_boot


@pytest.fixture(scope="module")
def pki() -> SimulatedPki:
    return SimulatedPki.generate()


def _firmware_td(pki: SimulatedPki) -> SimulatedTdx:
    """A TD standing in for a cloud's: its MRTD and RTMR0 (the simulated firmware's) are what
    the firmware inputs pin; its RTMR1/RTMR2 events are set per test."""
    return SimulatedTdx(pki, image="umbra-security-cvm")


def _firmware_inputs(path: Path, td: SimulatedTdx, drop: str | None = None) -> Path:
    gcp: dict[str, Any] = {
        "mrtd": [td.mr_td.hex()],
        "rtmr0": [replay([e for e in td.events if e.imr == 0])[0].hex()],
        "source": "the test's simulated firmware",
    }
    if drop is not None:
        gcp.pop(drop)
    doc = {"apiVersion": "umbra/v1", "kind": "TdFirmware", "clouds": {"gcp": gcp}}
    path.write_text(yaml.safe_dump(doc))
    return path


def _disks(tmp_path: Path, uki: Path, disk: Path) -> Path:
    data = uki.read_bytes()
    doc = {
        "raw": str(disk),
        "raw_sha256": hashlib.sha256(disk.read_bytes()).hexdigest(),
        "uki": str(uki),
        "uki_sha256": hashlib.sha256(data).hexdigest(),
        "uki_authenticode_sha384": authenticode_digest(data, "sha384"),
        "uki_authenticode_sha256": authenticode_digest(data, "sha256"),
        "cmdline": "root=/dev/mapper/umbra-root ro umbra.verity=" + "cd" * 32,
        "verity_root_hash": "cd" * 32,
    }
    path = tmp_path / "disks.json"
    path.write_text(json.dumps(doc))
    return path


def _measure(*args: str) -> Any:
    return runner.invoke(app, ["image", "measure", *args])


def test_measure_writes_a_signed_tdx_release_with_computed_rtmr1_and_rtmr2(
    uki: Path, tmp_path: Path, pki: SimulatedPki
) -> None:
    disk = fake_disk(tmp_path / "disk.raw")
    boot = _disks(tmp_path, uki, disk)
    td = _firmware_td(pki)
    fw = _firmware_inputs(tmp_path / "firmware.yaml", td)
    key = tmp_path / "release.key"
    assert runner.invoke(app, ["image", "keygen", str(key)]).exit_code == 0
    out = tmp_path / "gcp"
    r = _measure(str(SECURITY), "--boot", str(boot), "--cloud", "gcp", "--firmware", str(fw),
                 "--out", str(out), "--sign-key", str(key), "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    golden = golden_rtmrs(uki, disk)
    release = yaml.safe_load((out / "release.yaml").read_text())
    assert release["tee"] == "tdx"
    assert release["rtmr1"] == [golden.rtmr1.hex()] and release["rtmr2"] == [golden.rtmr2.hex()]
    assert release["mrtd"] == [td.mr_td.hex()]
    shown = json.loads(r.stdout)
    assert shown["cloud"] == "gcp" and shown["rtmr1"] == [golden.rtmr1.hex()]
    assert [e["digest"] for e in shown["td_boot_events"]] == [
        m.sha384.hex() for m in golden.measured
    ]
    assert (out / "td-boot-events.json").is_file()
    # Signed as every release manifest is: the signature covers the tdx values.
    signed = out / "measurement-manifest.signed.json"
    ok = runner.invoke(app, ["image", "verify-manifest", str(signed), "-k", f"{key}.pub"])
    assert ok.exit_code == 0, ok.output
    doc = json.loads(signed.read_text())
    assert doc["manifest"]["release"]["rtmr1"] == [golden.rtmr1.hex()]
    doc["manifest"]["release"]["rtmr1"] = ["00" * 48]
    signed.write_text(json.dumps(doc))
    bad = runner.invoke(app, ["image", "verify-manifest", str(signed), "-k", f"{key}.pub"])
    assert bad.exit_code == 1


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"drop": "rtmr0"}, "clouds.gcp.rtmr0"),
        ({"drop": "mrtd"}, "clouds.gcp.mrtd"),
        ({"cloud": "azure"}, "clouds.azure: missing: the paravisor's MRTD and the firmware's PCRs"),
        ({"no_firmware": True}, "--cloud, --firmware and --boot come together"),
        ({"cloud": "aws"}, "--cloud: 'aws' is not one of gcp, azure"),
    ],
    ids=["no-rtmr0", "no-mrtd", "no-azure", "no-firmware", "unknown-cloud"],
)
def test_a_missing_firmware_input_writes_no_release(
    uki: Path, tmp_path: Path, pki: SimulatedPki, change: dict[str, Any], says: str
) -> None:
    boot = _disks(tmp_path, uki, fake_disk(tmp_path / "disk.raw"))
    fw = _firmware_inputs(tmp_path / "firmware.yaml", _firmware_td(pki), change.get("drop"))
    args = [str(SECURITY), "--boot", str(boot), "--cloud", change.get("cloud", "gcp")]
    if not change.get("no_firmware"):
        args += ["--firmware", str(fw)]
    out = tmp_path / "out"
    r = _measure(*args, "--out", str(out))
    assert r.exit_code == 2, r.output
    assert says in " ".join(r.output.split()), r.output
    assert not out.exists()


def test_a_firmware_document_without_the_cloud_or_a_changed_uki_is_refused(
    uki: Path, tmp_path: Path, pki: SimulatedPki
) -> None:
    boot = _disks(tmp_path, uki, fake_disk(tmp_path / "disk.raw"))
    fw = tmp_path / "firmware.yaml"
    other = {"mrtd": ["11" * 48], "pcrs": {i: ["22" * 32] for i in FIRMWARE_PCRS}, "source": "x"}
    fw.write_text(yaml.safe_dump({"apiVersion": "umbra/v1", "kind": "TdFirmware",
                                  "clouds": {"azure": other}}))  # fmt: skip
    r = _measure(str(SECURITY), "--boot", str(boot), "--cloud", "gcp", "--firmware", str(fw))
    assert r.exit_code == 2 and "clouds.gcp: missing" in " ".join(r.output.split()), r.output
    _firmware_inputs(fw, _firmware_td(pki))
    data = bytearray(uki.read_bytes())
    data[next(s for s in sections(bytes(data)) if s.name == ".cmdline").raw_ptr] ^= 1
    uki.write_bytes(bytes(data))  # after `umbra image disks` described it
    r = _measure(str(SECURITY), "--boot", str(boot), "--cloud", "gcp", "--firmware", str(fw))
    assert r.exit_code == 2 and "changed after the disks were built" in r.output, r.output
    # A definition whose forwarder accepts simulated quotes is never a tdx release.
    boot = _disks(tmp_path, uki, fake_disk(tmp_path / "disk.raw"))
    dev = DEFS / "dev-cvm.example.yaml"
    r = _measure(str(dev), "--boot", str(boot), "--cloud", "gcp", "--firmware", str(fw))
    assert r.exit_code == 2 and "must not let its forwarder accept simulated" in r.output


def _td_booting(pki: SimulatedPki, golden_events: list[Event], compose_hash: bytes) -> SimulatedTdx:
    """A TD whose firmware logged RTMR0 (the simulated cloud firmware's) and the computed
    RTMR1/RTMR2 events, then its agent the compose hash and CVM id into RTMR3."""
    td = _firmware_td(pki)
    td.events = [e for e in td.events if e.imr == 0] + golden_events
    td.extend_runtime_event("compose-hash", compose_hash)
    td.extend_runtime_event(CVM_ID_EVENT, b"sec-1")
    return td


def test_the_verifier_accepts_the_computed_values_and_refuses_wrong_ones(
    uki: Path, tmp_path: Path, pki: SimulatedPki
) -> None:
    disk = fake_disk(tmp_path / "disk.raw")
    fw = _firmware_inputs(tmp_path / "firmware.yaml", _firmware_td(pki))
    collateral = StaticCollateral(pki.collateral(int(time.time()) - 60))

    def release_for(efi: Path, name: str) -> ReleaseManifest:
        out = tmp_path / name
        boot = _disks(tmp_path, efi, disk)
        r = _measure(str(SECURITY), "--boot", str(boot), "--cloud", "gcp", "--firmware", str(fw),
                     "--out", str(out))  # fmt: skip
        assert r.exit_code == 0, r.output
        doc = yaml.safe_load((out / "release.yaml").read_text())
        # The quotes here are the simulated PKI's: the same values, verified under its root.
        return ReleaseManifest.model_validate({**doc, "tee": "simulated"})

    right = release_for(uki, "right")
    changed = tmp_path / "changed.efi"
    data = bytearray(uki.read_bytes())
    data[next(s for s in sections(bytes(data)) if s.name == ".linux").raw_ptr + 99] ^= 1
    changed.write_bytes(bytes(data))
    wrong = release_for(changed, "wrong")
    assert wrong.rtmr1 != right.rtmr1

    compose_hash = measure(load_definition(SECURITY)).compose_hash
    td = _td_booting(pki, golden_rtmrs(uki, disk).events(), compose_hash)
    assert replay(td.event_log())[1:3] == (
        bytes.fromhex(right.rtmr1[0]),  # type: ignore[index]
        bytes.fromhex(right.rtmr2[0]),  # type: ignore[index]
    )
    quote = td.quote(b"nonce")
    for release, ok in ((right, True), (wrong, False)):
        verdict = Verifier(
            MeasurementPolicy(release=release), collateral, True, pki.root_der
        ).verify(quote, event_log=td.event_log())
        assert verdict.ok is ok, verdict.reasons
        if not ok:
            assert any("RTMR1" in r for r in verdict.reasons), verdict.reasons
    # The simulator's stand-in boot events are not the computed ones: another RTMR1.
    assert replay(boot_events("umbra-security-cvm"))[1] != bytes.fromhex(right.rtmr1[0])  # type: ignore[index]
