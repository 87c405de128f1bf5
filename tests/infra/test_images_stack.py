"""The images stack (infra/images, `run_images`) under `set_mocks`: the release document that
`umbra image os-release` writes from the built disks, the release certificate and the upload
targets publishes a TDX-capable GCP image and a ConfidentialVM gallery image version, each with
the release's Secure Boot db; a disk signed for another certificate, an unknown target, a missing
or malformed document are refused naming the cause. Nothing is applied to a cloud."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pulumi
import pytest
from typer.testing import CliRunner

from umbra.cli.app import app
from umbra.components.os_image import load_release, run_images
from umbra.images.publish import PublishError, os_release, release_json
from umbra.images.secure_boot import secure_boot_db

from ..images.sb_keys import make_signer
from .harness import run_program

RAW = "cd" * 32
TARGETS: dict[str, Any] = {
    "gcp": {
        "project": "acme-umbra",
        "tarball_url": "https://storage.googleapis.com/acme-umbra-images/2.0.1/umbra-gcp.tar.gz",
    },
    "azure": {
        "resource_group": "umbra-images",
        "location": "westeurope",
        "gallery": "umbra",
        "storage_account_id": "/subscriptions/s/resourceGroups/umbra-images/providers/"
        "Microsoft.Storage/storageAccounts/umbraimages",
        "vhd_url": "https://umbraimages.blob.core.windows.net/vhds/umbra-azure-2.0.1.vhd",
    },
}


def _built(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """`umbra image disks --json` as the workflow's os-image job writes it (its fields used)."""
    cert = make_signer(tmp_path / "sb").cert
    disks = {"raw_sha256": RAW, "secure_boot_cert_sha256": secure_boot_db(cert).cert_sha256}
    return disks, cert


def test_the_stack_publishes_both_clouds_from_the_built_release(tmp_path: Path) -> None:
    disks, cert = _built(tmp_path)
    release = os_release(disks, cert, "2.0.1", TARGETS)
    config = {"umbra:release": release_json(release)}  # the mocks' project is `umbra`
    rec, _ = run_program(run_images, config=config)
    image = rec.one("gcp:compute/image:Image", "umbra-os-gcp").inputs
    assert image["name"] == "umbra-cvm-2-0-1" and image["rawDisk"]["source"].endswith(".tar.gz")
    # The features come from images/os/gcp.yaml, not from the caller.
    assert {"UEFI_COMPATIBLE", "TDX_CAPABLE"} <= {f["type"] for f in image["guestOsFeatures"]}
    cert_buf = {"content": release.secure_boot.cert_der_b64, "fileType": "X509"}
    assert image["shieldedInstanceInitialState"]["dbs"] == [cert_buf]
    definition = rec.one("azure-native:compute:GalleryImage", "umbra-os-azure-definition").inputs
    assert {"name": "SecurityType", "value": "ConfidentialVM"} in definition["features"]
    assert definition["hyperVGeneration"] == "V2"
    version = rec.one("azure-native:compute:GalleryImageVersion", "umbra-os-azure").inputs
    assert version["galleryImageVersionName"] == "2.0.1"
    uefi = version["securityProfile"]["uefiSettings"]
    assert uefi["signatureTemplateNames"] == ["NoSignatureTemplate"]
    assert uefi["additionalSignatures"]["db"] == [
        {"type": "x509", "value": [release.secure_boot.cert_der_b64]}
    ]


def test_one_cloud_only_declares_only_that_cloud(tmp_path: Path) -> None:
    disks, cert = _built(tmp_path)
    release = os_release(disks, cert, "2.0.1", {"gcp": TARGETS["gcp"]})
    rec, _ = run_program(run_images, config={"umbra:release": release_json(release)})
    assert len(rec.of_type("gcp:compute/image:Image")) == 1
    assert not rec.of_type("azure-native:compute:GalleryImageVersion")


def test_a_disk_signed_for_another_certificate_is_refused(tmp_path: Path) -> None:
    disks, _ = _built(tmp_path)
    other = make_signer(tmp_path / "other", "Someone else").cert
    with pytest.raises(PublishError, match="would not boot under the image's Secure Boot db"):
        os_release(disks, other, "2.0.1", TARGETS)
    with pytest.raises(PublishError, match="would not boot"):  # an unsigned UKI's disks
        os_release(disks | {"secure_boot_cert_sha256": None}, other, "2.0.1", TARGETS)


@pytest.mark.parametrize(
    ("targets", "version", "message"),
    [
        ({"aws": {}}, "2.0.1", "unknown: ['aws']"),
        ({}, "2.0.1", "give gcp, azure or both"),
        ({"gcp": TARGETS["gcp"] | {"tarball_url": "http://x/d.tar.gz"}}, "2.0.1", "tarball_url"),
        ({"azure": {"location": "westeurope"}}, "2.0.1", "targets.azure.resource_group"),
        (TARGETS, "2.0", "release.version"),
    ],
)
def test_bad_targets_or_version_are_refused_naming_the_field(
    tmp_path: Path, targets: dict[str, Any], version: str, message: str
) -> None:
    disks, cert = _built(tmp_path)
    with pytest.raises(PublishError, match=message.replace("[", r"\[").replace("]", r"\]")):
        os_release(disks, cert, version, targets)


def test_a_missing_or_malformed_release_config_is_refused_without_a_traceback(
    tmp_path: Path,
) -> None:
    with pytest.raises(pulumi.RunError, match="is not set"):
        load_release(None)
    with pytest.raises(pulumi.RunError, match="is invalid"):
        load_release("{not json")
    disks, cert = _built(tmp_path)
    doc = json.loads(release_json(os_release(disks, cert, "2.0.1", TARGETS)))
    with pytest.raises(pulumi.RunError, match="raw_sha256"):
        load_release(json.dumps(doc | {"raw_sha256": "nope"}))
    with pytest.raises(pulumi.RunError, match="names no cloud"):
        load_release(json.dumps({k: v for k, v in doc.items() if k not in ("gcp", "azure")}))


def test_cli_os_release_writes_the_stacks_config_value(tmp_path: Path) -> None:
    disks, cert = _built(tmp_path)
    (tmp_path / "disks.json").write_text(json.dumps(disks))
    (tmp_path / "targets.json").write_text(json.dumps(TARGETS))
    args = ["image", "os-release", str(tmp_path / "disks.json"), "--sb-cert", str(cert),
            "--version", "2.0.1", "--targets", str(tmp_path / "targets.json")]  # fmt: skip
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    assert load_release(done.stdout.strip()).version == "2.0.1"
    (tmp_path / "targets.json").write_text(json.dumps({"aws": {}}))
    bad = CliRunner().invoke(app, args)
    assert bad.exit_code == 2 and "aws" in bad.output and "Traceback" not in bad.output
