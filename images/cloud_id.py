"""Which cloud the VM runs on, from the firmware's SMBIOS system information (what the guest sees
in /sys/class/dmi/id), as the clouds themselves identify: GCP's `sys_vendor` is `Google`
(product `Google Compute Engine`), Azure's is `Microsoft Corporation` (product `Virtual
Machine`). The launch agent's `--cloud smbios` reads it, so one image (the emulated clouds'
`qemu.yaml`) takes the GCP or the Azure path depending on how it was booted; the cloud images
name their cloud outright (`--cloud gcp|azure`)."""

from __future__ import annotations

from pathlib import Path

DMI = Path("/sys/class/dmi/id")
VENDORS = {"Google": "gcp", "Microsoft Corporation": "azure"}


class UnknownCloud(Exception):
    pass


def cloud_from_smbios(dmi: Path = DMI) -> str:
    try:
        vendor = (dmi / "sys_vendor").read_text().strip()
    except OSError as exc:
        raise UnknownCloud(f"{dmi}/sys_vendor: {exc.strerror}") from None
    cloud = VENDORS.get(vendor)
    if cloud is None:
        raise UnknownCloud(
            f"SMBIOS system vendor {vendor!r} is neither GCP's (Google) nor Azure's "
            "(Microsoft Corporation)"
        )
    return cloud
