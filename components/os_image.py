"""Publishing the CVM OS image as code: the disks `umbra image disks` wrote, uploaded by the
release workflow, become a GCP image and an Azure Compute Gallery image version, each carrying
the image's Secure Boot db (images.secure_boot: the release certificate as PK, KEK and db).

- GCP: `compute.Image` from the `disk.raw` tarball's GCS URL, with the OS definition's guest OS
  features (images/os/gcp.yaml: UEFI_COMPATIBLE, TDX_CAPABLE, GVNIC, …) and
  `shielded_instance_initial_state` = the db document's GCP shape.
- Azure: a gallery image definition (Linux, generalized, Gen2, security type ConfidentialVM as
  images/os/azure.yaml says) and an image version from the fixed VHD's page blob URI, with
  `security_profile.uefi_settings` = the db document's Azure shape (no Microsoft template).

The uploads are not resources here: azure-native's `storage.Blob` makes only block and append
blobs, and a gallery image version needs a page blob, so the workflow uploads both disks and
passes their URIs. Nothing here has been applied to a cloud (no Pulumi CLI, no credentials):
the arguments are tested with `pulumi.runtime.set_mocks`.

The images stack (`infra/images/`, its own Pulumi project `umbra-images`) runs `run_images`:
one config value, `umbra-images:release`, the OsImageRelease document the release workflow
writes (`umbra image os-release`), declares the image in the clouds it names.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pulumi
import pulumi_azure_native as azure
import pulumi_gcp as gcp
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from umbra.contracts.secure_boot import SecureBootDb
from umbra.contracts.validation import lines

COMPONENT_TYPE = "umbra:images:OsImage"
RELEASE_CONFIG = "release"  # umbra-images:release, the OsImageRelease document (JSON)
# Azure gallery image versions are Major.Minor.Patch (each a 32-bit integer).
_VERSION = re.compile(r"^(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})$")
_SHA256 = r"^[0-9a-f]{64}$"


class GcpTarget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    project: str = Field(min_length=1)
    tarball_url: str = Field(pattern=r"^https://storage\.googleapis\.com/[^/]+/.+\.tar\.gz$")
    family: str = Field(default="umbra-cvm", pattern=r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
    # images/os/gcp.yaml's guest_os_features (the workflow passes them: components sit below images)
    guest_os_features: list[str] = Field(min_length=1)


class AzureTarget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    resource_group: str = Field(min_length=1)
    location: str = Field(min_length=1)
    gallery: str = Field(min_length=1)
    storage_account_id: str = Field(pattern=r"^/subscriptions/.+/storageAccounts/[^/]+$")
    vhd_url: str = Field(pattern=r"^https://[a-z0-9]+\.blob\.core\.windows\.net/.+\.vhd$")
    image_definition: str = Field(default="umbra-cvm", min_length=1)
    # images/os/azure.yaml's security type and Hyper-V generation
    security_type: str = "ConfidentialVM"
    hyper_v_generation: str = "V2"


class OsImageRelease(BaseModel):
    """One built OS image: its version, the raw disk's digest and its Secure Boot db."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: str = Field(pattern=_VERSION.pattern)
    raw_sha256: str = Field(pattern=_SHA256)
    secure_boot: SecureBootDb
    gcp: GcpTarget | None = None
    azure: AzureTarget | None = None


def gcp_initial_state(db: SecureBootDb) -> gcp.compute.ImageShieldedInstanceInitialStateArgs:
    shape = db.gcp_initial_state()

    def buf(b: dict[str, str]) -> dict[str, str]:
        return {"content": b["content"], "file_type": b["fileType"]}

    return gcp.compute.ImageShieldedInstanceInitialStateArgs(
        pk=gcp.compute.ImageShieldedInstanceInitialStatePkArgs(**buf(shape["pk"])),
        keks=[
            gcp.compute.ImageShieldedInstanceInitialStateKekArgs(**buf(k)) for k in shape["keks"]
        ],
        dbs=[gcp.compute.ImageShieldedInstanceInitialStateDbArgs(**buf(d)) for d in shape["dbs"]],
        dbxs=[],
    )


def azure_uefi_settings(db: SecureBootDb) -> azure.compute.GalleryImageVersionUefiSettingsArgs:
    shape: dict[str, Any] = db.azure_uefi_settings()
    sigs = shape["additionalSignatures"]

    def key(k: dict[str, Any]) -> azure.compute.UefiKeyArgs:
        return azure.compute.UefiKeyArgs(type=k["type"], value=list(k["value"]))

    return azure.compute.GalleryImageVersionUefiSettingsArgs(
        signature_template_names=list(shape["signatureTemplateNames"]),
        additional_signatures=azure.compute.UefiKeySignaturesArgs(
            pk=key(sigs["pk"]), kek=[key(k) for k in sigs["kek"]], db=[key(d) for d in sigs["db"]]
        ),
    )


class OsImage(pulumi.ComponentResource):
    """The OS image release published to the targets it names."""

    gcp_image: gcp.compute.Image | None
    azure_version: azure.compute.GalleryImageVersion | None

    def __init__(
        self, name: str, release: OsImageRelease, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__(COMPONENT_TYPE, name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        dashed = release.version.replace(".", "-")
        labels = {"umbra-os-image": dashed, "umbra-raw-sha256": release.raw_sha256[:63]}
        self.gcp_image = None
        self.azure_version = None
        if release.gcp is not None:
            features = release.gcp.guest_os_features
            self.gcp_image = gcp.compute.Image(
                f"{name}-gcp",
                name=f"umbra-cvm-{dashed}",
                project=release.gcp.project,
                family=release.gcp.family,
                raw_disk=gcp.compute.ImageRawDiskArgs(source=release.gcp.tarball_url),
                guest_os_features=[gcp.compute.ImageGuestOsFeatureArgs(type=f) for f in features],
                shielded_instance_initial_state=gcp_initial_state(release.secure_boot),
                labels=labels,
                opts=child,
            )
        if release.azure is not None:
            a = release.azure
            image = azure.compute.GalleryImage(
                f"{name}-azure-definition",
                resource_group_name=a.resource_group,
                location=a.location,
                gallery_name=a.gallery,
                gallery_image_name=a.image_definition,
                os_type=azure.compute.OperatingSystemTypes.LINUX,
                os_state=azure.compute.OperatingSystemStateTypes.GENERALIZED,
                hyper_v_generation=a.hyper_v_generation,
                architecture="x64",
                identifier=azure.compute.GalleryImageIdentifierArgs(
                    publisher="umbra", offer="umbra-cvm", sku="tdx"
                ),
                features=[
                    azure.compute.GalleryImageFeatureArgs(
                        name="SecurityType", value=a.security_type
                    )
                ],
                opts=child,
            )
            self.azure_version = azure.compute.GalleryImageVersion(
                f"{name}-azure",
                resource_group_name=a.resource_group,
                location=a.location,
                gallery_name=a.gallery,
                gallery_image_name=image.name,
                gallery_image_version_name=release.version,
                storage_profile=azure.compute.GalleryImageVersionStorageProfileArgs(
                    os_disk_image=azure.compute.GalleryOSDiskImageArgs(
                        source=azure.compute.GalleryDiskImageSourceArgs(
                            storage_account_id=a.storage_account_id, uri=a.vhd_url
                        )
                    )
                ),
                security_profile=azure.compute.ImageVersionSecurityProfileArgs(
                    uefi_settings=azure_uefi_settings(release.secure_boot)
                ),
                tags=labels,
                opts=child,
            )
        self.register_outputs({})


def load_release(raw: str | None, where: str = "umbra-images:release") -> OsImageRelease:
    """The stack's release document; a bad one is refused naming the field, never a traceback."""
    if not raw:
        raise pulumi.RunError(f"{where} is not set: `umbra image os-release … > release.json`, "
                              f"then `pulumi config set {where} \"$(cat release.json)\"`")  # fmt: skip
    try:
        release = OsImageRelease.model_validate(json.loads(raw))
    except ValueError as exc:  # ValidationError is a ValueError
        detail = lines(exc, "(top level)") if isinstance(exc, ValidationError) else [str(exc)]
        raise pulumi.RunError(f"{where} is invalid:\n" + "\n".join(detail)) from None
    if release.gcp is None and release.azure is None:
        raise pulumi.RunError(f"{where} names no cloud: give gcp, azure or both")
    return release


def run_images() -> OsImage:
    """The images stack's program: publish the release where it says, export what was made."""
    release = load_release(pulumi.Config().get(RELEASE_CONFIG))
    image = OsImage("umbra-os", release)
    pulumi.export("version", release.version)
    pulumi.export("raw_sha256", release.raw_sha256)
    if image.gcp_image is not None:
        pulumi.export("gcp_image", image.gcp_image.self_link)
    if image.azure_version is not None:
        pulumi.export("azure_image_version", image.azure_version.id)
    return image
