"""A `tee: tdx` release of one image definition for one cloud: MRTD and RTMR0 from that cloud's
firmware (inputs: pinned values with where they came from, never computed or guessed), RTMR1 and
RTMR2 computed from the built UKI and disk (images.td_boot).

The firmware inputs are one YAML document (`kind: TdFirmware`), per cloud:
`mrtd`, `rtmr0` (lists: several firmware builds may be accepted) and `source` (the provider's
endorsement or publication they were taken from). A cloud or a value missing is refused naming
the file and field: a release is never written with a register left open.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError

from umbra.attest.measurement import Hex48
from umbra.contracts.model import Strict as _Strict
from umbra.contracts.validation import lines
from umbra.images.definition import DefinitionError, ImageDefinition, parse_definition
from umbra.images.td_boot import (
    EV_EFI_BOOT_SERVICES_APPLICATION,
    TdBootError,
    TdBootGolden,
    golden_rtmrs,
)


class Cloud(StrEnum):
    gcp = "gcp"
    azure = "azure"


class CloudFirmware(_Strict):
    mrtd: list[Hex48] = Field(min_length=1)
    rtmr0: list[Hex48] = Field(min_length=1)
    source: str = Field(min_length=1)  # e.g. the GCP launch endorsement's URL and firmware build


class TdFirmware(_Strict):
    apiVersion: Literal["umbra/v1"]
    kind: Literal["TdFirmware"]
    clouds: dict[Cloud, CloudFirmware] = Field(min_length=1)


class TdReleaseError(Exception):
    """No tdx release can be written; the message names the file and field."""


# Azure's TDX CVMs run the guest under a paravisor that measures its boot into a vTPM's PCRs
# and leaves RTMR0-2 zero (attestation.md, platform azure-tdx): computed RTMR1/2 never match.
AZURE_REFUSAL = (
    "azure: a TDX CVM under Azure's paravisor measures the guest's boot into its vTPM's PCRs "
    "and keeps RTMR1/RTMR2 zero (platform azure-tdx), so a tee: tdx release with computed "
    "RTMR1/RTMR2 would never verify; golden PCRs for platform azure-tdx are not built"
)


def load_firmware(path: Path) -> TdFirmware:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise TdReleaseError(f"{path}: cannot read: {exc}") from None
    try:
        return TdFirmware.model_validate(doc)
    except ValidationError as exc:
        problems = [f"{path}: {line}" for line in lines(exc, "(top level)")]
        raise TdReleaseError("\n".join(problems)) from None


def cloud_firmware(firmware: TdFirmware, cloud: Cloud, source: str) -> CloudFirmware:
    if cloud is Cloud.azure:
        raise TdReleaseError(AZURE_REFUSAL)
    found = firmware.clouds.get(cloud)
    if found is None:
        raise TdReleaseError(
            f"{source}: clouds.{cloud}: missing: the MRTD and RTMR0 of {cloud}'s TD firmware "
            "(its published launch endorsement) are inputs, never computed"
        )
    return found


def tdx_definition(
    definition: ImageDefinition, cloud: Cloud, firmware: TdFirmware, golden: TdBootGolden,
    source: str,
) -> ImageDefinition:  # fmt: skip
    """The definition as a `tee: tdx` release for `cloud`: every tdx rule of
    images.definition applies (no simulated quoting, no simulated forwarder)."""
    fw = cloud_firmware(firmware, cloud, source)
    doc: dict[str, Any] = definition.model_dump(mode="json", exclude_none=True)
    doc["tee"] = "tdx"
    doc["base"] = {
        "mrtd": list(fw.mrtd),
        "rtmr0": list(fw.rtmr0),
        "rtmr1": [golden.rtmr1.hex()],
        "rtmr2": [golden.rtmr2.hex()],
    }
    try:
        return parse_definition(doc, f"{definition.name} as tee: tdx for {cloud}")
    except DefinitionError as exc:
        raise TdReleaseError(str(exc)) from None


def golden_from_disks(disks: Mapping[str, object], source: str) -> TdBootGolden:
    """RTMR1/RTMR2 of the UKI and disk `umbra image disks --json` wrote (its `uki` and `raw`
    paths), refused unless that UKI is the one the document describes."""
    uki, raw = disks.get("uki"), disks.get("raw")
    if not isinstance(uki, str) or not isinstance(raw, str):
        raise TdReleaseError(f"{source}: uki and raw (the built files' paths) are required")
    try:
        golden = golden_rtmrs(Path(uki), Path(raw))
    except TdBootError as exc:
        raise TdReleaseError(str(exc)) from None
    app = next(m for m in golden.measured if m.event_type == EV_EFI_BOOT_SERVICES_APPLICATION)
    if app.sha384.hex() != disks.get("uki_authenticode_sha384"):
        raise TdReleaseError(
            f"{source}: uki_authenticode_sha384 is not the Authenticode hash of {uki} "
            f"({app.sha384.hex()}): the file changed after the disks were built"
        )
    return golden
