"""`--cloud smbios` (images/cloud_id.py): the cloud is the firmware's SMBIOS system vendor, as GCP
and Azure set it (and as the emulated clouds' QEMU sets it); anything else is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from umbra.emulated.qemu import SMBIOS
from umbra.images.cloud_id import UnknownCloud, cloud_from_smbios


@pytest.mark.parametrize(
    ("vendor", "cloud"), [("Google", "gcp"), ("Microsoft Corporation", "azure")]
)
def test_the_clouds_vendors(tmp_path: Path, vendor: str, cloud: str) -> None:
    (tmp_path / "sys_vendor").write_text(vendor + "\n")
    assert cloud_from_smbios(tmp_path) == cloud


def test_the_emulated_clouds_say_what_the_clouds_say(tmp_path: Path) -> None:
    for shape, (manufacturer, _product) in SMBIOS.items():
        (tmp_path / "sys_vendor").write_text(manufacturer + "\n")
        assert cloud_from_smbios(tmp_path) == shape


def test_any_other_vendor_or_none_is_refused(tmp_path: Path) -> None:
    (tmp_path / "sys_vendor").write_text("QEMU\n")
    with pytest.raises(UnknownCloud, match="SMBIOS system vendor 'QEMU' is neither GCP's"):
        cloud_from_smbios(tmp_path)
    with pytest.raises(UnknownCloud, match="sys_vendor"):
        cloud_from_smbios(tmp_path / "absent")
