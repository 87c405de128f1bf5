"""The OS image published as code (components/os_image.py) under `set_mocks`: the GCP image and
the Azure gallery image version carry the TDX guest features and the image's Secure Boot db."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from umbra.components.os_image import AzureTarget, GcpTarget, OsImage, OsImageRelease
from umbra.images.os_image import OS_DIR, load_os_definition
from umbra.images.secure_boot import secure_boot_db

from ..images.sb_keys import make_signer
from .harness import run_program

RAW = "ab" * 32


def _release(tmp_path: Path, **targets: object) -> OsImageRelease:
    db = secure_boot_db(make_signer(tmp_path / "sb").cert)
    return OsImageRelease.model_validate(
        {"version": "1.4.0", "raw_sha256": RAW, "secure_boot": db, **targets}
    )


GCP = GcpTarget(
    project="acme-umbra",
    tarball_url="https://storage.googleapis.com/acme-umbra-images/1.4.0/umbra-gcp.tar.gz",
    guest_os_features=list(load_os_definition(OS_DIR / "gcp.yaml").guest_os_features),
)
AZURE = AzureTarget(
    resource_group="umbra-images",
    location="westeurope",
    gallery="umbra",
    storage_account_id="/subscriptions/s/resourceGroups/umbra-images/providers/"
    "Microsoft.Storage/storageAccounts/umbraimages",
    vhd_url="https://umbraimages.blob.core.windows.net/vhds/umbra-azure-1.4.0.vhd",
)


def test_gcp_image_is_tdx_capable_with_our_secure_boot_db(tmp_path: Path) -> None:
    release = _release(tmp_path, gcp=GCP)
    rec, _ = run_program(lambda: OsImage("os", release))
    image = rec.one("gcp:compute/image:Image", "os-gcp").inputs
    assert image["name"] == "umbra-cvm-1-4-0" and image["family"] == "umbra-cvm"
    assert image["rawDisk"] == {"source": GCP.tarball_url}
    features = {f["type"] for f in image["guestOsFeatures"]}
    assert {"UEFI_COMPATIBLE", "TDX_CAPABLE", "GVNIC"} <= features
    state = image["shieldedInstanceInitialState"]
    cert = {"content": release.secure_boot.cert_der_b64, "fileType": "X509"}
    assert state["dbs"] == [cert] and state["keks"] == [cert] and state["pk"] == cert
    assert not state.get("dbxs")
    assert not rec.of_type("azure-native:compute:GalleryImageVersion")


def test_azure_image_version_is_a_confidential_vm_image_with_our_uefi_keys(tmp_path: Path) -> None:
    release = _release(tmp_path, azure=AZURE)
    rec, _ = run_program(lambda: OsImage("os", release))
    definition = rec.one("azure-native:compute:GalleryImage", "os-azure-definition").inputs
    assert definition["hyperVGeneration"] == "V2" and definition["osType"] == "Linux"
    assert definition["osState"] == "Generalized"
    assert {"name": "SecurityType", "value": "ConfidentialVM"} in definition["features"]
    version = rec.one("azure-native:compute:GalleryImageVersion", "os-azure").inputs
    assert version["galleryImageVersionName"] == "1.4.0"
    assert version["storageProfile"]["osDiskImage"]["source"] == {
        "storageAccountId": AZURE.storage_account_id,
        "uri": AZURE.vhd_url,
    }
    uefi = version["securityProfile"]["uefiSettings"]
    assert uefi["signatureTemplateNames"] == ["NoSignatureTemplate"]
    key = {"type": "x509", "value": [release.secure_boot.cert_der_b64]}
    sigs = uefi["additionalSignatures"]
    assert sigs["db"] == [key] and sigs["kek"] == [key] and sigs["pk"] == key
    assert not rec.of_type("gcp:compute/image:Image")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("version", "1.4"),
        ("version", "01.4.0"),
        ("raw_sha256", "xyz"),
        ("gcp", {"project": "p", "tarball_url": "http://example.test/disk.tar.gz"}),
    ],
)
def test_a_malformed_release_is_refused_naming_the_field(
    tmp_path: Path, field: str, value: object
) -> None:
    db = secure_boot_db(make_signer(tmp_path / "sb").cert)
    data: dict[str, object] = {"version": "1.4.0", "raw_sha256": RAW, "secure_boot": db}
    data[field] = value
    with pytest.raises(ValidationError) as err:
        OsImageRelease.model_validate(data)
    assert err.value.errors()[0]["loc"][0] == field
