"""The images stack's input (components/os_image.py's OsImageRelease) from what the release
workflow built: `umbra image disks --json` (the raw disk's SHA-256, the certificate the UKI was
signed for), the release's Secure Boot certificate, the version, and where the uploads went
(a targets document: GCP project and tarball URL, Azure gallery and VHD URL). The clouds' image
features come from the OS definitions (images/os/gcp.yaml, azure.yaml), not from the caller:
the image is published as the definition it was built from says."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from umbra.components.os_image import AzureTarget, GcpTarget, OsImageRelease
from umbra.contracts.validation import lines
from umbra.images.os_image import OS_DIR, load_os_definition
from umbra.images.secure_boot import secure_boot_db


class PublishError(Exception):
    pass


def os_release(
    disks: Mapping[str, Any],
    cert: Path,
    version: str,
    targets: Mapping[str, Any],
    os_dir: Path = OS_DIR,
) -> OsImageRelease:
    """Raises PublishError naming the document and field."""
    db = secure_boot_db(cert)
    signed_for = disks.get("secure_boot_cert_sha256")
    if signed_for != db.cert_sha256:
        # An unsigned UKI, or one signed for another key, would not boot under this db.
        raise PublishError(
            f"disks: the UKI was signed for certificate {signed_for!r}, not {cert} "
            f"({db.cert_sha256}): it would not boot under the image's Secure Boot db"
        )
    unknown = sorted(set(targets) - {"gcp", "azure"})
    if unknown or not targets:
        raise PublishError(f"targets: give gcp, azure or both (unknown: {unknown})")
    doc: dict[str, Any] = {
        "version": version,
        "raw_sha256": disks.get("raw_sha256"),
        "secure_boot": db,
    }
    where = "targets"
    try:
        if "gcp" in targets:
            where = "targets.gcp"
            features = load_os_definition(os_dir / "gcp.yaml").guest_os_features
            doc["gcp"] = GcpTarget.model_validate(
                dict(targets["gcp"]) | {"guest_os_features": list(features)}
            )
        if "azure" in targets:
            where = "targets.azure"
            azure = load_os_definition(os_dir / "azure.yaml")
            extra = {
                k: v
                for k, v in (
                    ("security_type", azure.security_type),
                    ("hyper_v_generation", azure.hyper_v_generation),
                )
                if v
            }
            doc["azure"] = AzureTarget.model_validate(dict(targets["azure"]) | extra)
        where = "release"
        return OsImageRelease.model_validate(doc)
    except ValidationError as exc:
        problems = [f"{where}.{line}" for line in lines(exc, "(top level)")]
        raise PublishError("\n".join(problems)) from None
    except (TypeError, ValueError) as exc:  # a target that is not a mapping
        raise PublishError(f"{where}: {exc}") from None


def release_json(release: OsImageRelease) -> str:
    """What `pulumi config set umbra-images:release` takes (one line of JSON)."""
    return json.dumps(release.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
