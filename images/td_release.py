"""A `tee: tdx` release of one image definition for one cloud: what the cloud's firmware
measures comes from inputs (pinned values with where they came from, never computed or
guessed), what our UKI and disk determine is computed from the built files (images.td_boot).

- gcp (`platform: tdx`): MRTD and RTMR0 are inputs; RTMR1 and RTMR2 are computed.
- azure (`platform: azure-tdx`): the paravisor keeps RTMR0-2 zero and measures the guest's boot
  into its vTPM. MRTD (the paravisor's) and the firmware's PCRs (FIRMWARE_PCRS) are inputs; the
  image's SHA-256 PCRs (td_boot.TPM_PCRS) are computed.

The firmware inputs are one YAML document (`kind: TdFirmware`), per cloud: `mrtd`, then `rtmr0`
(gcp) or `pcrs` (azure) — lists: several firmware builds may be accepted — and `source` (the
provider's endorsement or publication they were taken from). A cloud or a value missing is
refused naming the file and field: a release never leaves a register or boot PCR open.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from umbra.attest.measurement import Hex32, Hex48, PcrIndex
from umbra.contracts.model import Strict as _Strict
from umbra.contracts.validation import lines
from umbra.images.definition import DefinitionError, ImageDefinition, parse_definition
from umbra.images.td_boot import (
    EV_EFI_BOOT_SERVICES_APPLICATION,
    TPM_PCRS,
    TdBootError,
    TdBootGolden,
    TpmBootGolden,
    golden_pcrs,
    golden_rtmrs,
)


class Cloud(StrEnum):
    gcp = "gcp"
    azure = "azure"


class CloudFirmware(_Strict):
    mrtd: list[Hex48] = Field(min_length=1)
    rtmr0: list[Hex48] = Field(min_length=1)
    source: str = Field(min_length=1)  # e.g. the GCP launch endorsement's URL and firmware build


# The pre-OS PCRs (TCG PC Client: 0-7) that Azure's firmware and paravisor extend whatever disk
# boots: code (0, 2), configuration (1, 3, 6) and Secure Boot policy (7: PK, KEK, db, dbx and
# the db authority that admitted the UKI). 4 and 5 are the image's (td_boot.TPM_PCRS).
FIRMWARE_PCRS = (0, 1, 2, 3, 6, 7)


def _listed(pcrs: list[int]) -> str:
    return ", ".join(map(str, pcrs))


class AzureFirmware(_Strict):
    mrtd: list[Hex48] = Field(min_length=1)  # the paravisor's, from its published measurements
    pcrs: dict[PcrIndex, list[Hex32]] = Field(min_length=1)
    source: str = Field(min_length=1)

    @model_validator(mode="after")
    def _firmware_pcrs_only(self) -> AzureFirmware:
        computed = sorted(set(self.pcrs) & set(TPM_PCRS))
        if computed:
            raise ValueError(
                f"pcrs {_listed(computed)}: computed from the image's UKI and disk, never a "
                "firmware input"
            )
        missing = [i for i in FIRMWARE_PCRS if i not in self.pcrs]
        if missing:
            raise ValueError(
                f"pcrs {_listed(missing)}: missing: the firmware's PCRs "
                f"{_listed(list(FIRMWARE_PCRS))} are inputs, all required"
            )
        return self


class Clouds(_Strict):
    gcp: CloudFirmware | None = None
    azure: AzureFirmware | None = None

    @model_validator(mode="after")
    def _some(self) -> Clouds:
        if self.gcp is None and self.azure is None:
            raise ValueError("no cloud: give gcp and/or azure")
        return self


class TdFirmware(_Strict):
    apiVersion: Literal["umbra/v1"]
    kind: Literal["TdFirmware"]
    clouds: Clouds


class TdReleaseError(Exception):
    """No tdx release can be written; the message names the file and field."""


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


def _missing(cloud: Cloud, source: str) -> TdReleaseError:
    what = (
        "the MRTD and RTMR0 of gcp's TD firmware (its published launch endorsement) are"
        if cloud is Cloud.gcp
        else f"the paravisor's MRTD and the firmware's PCRs {_listed(list(FIRMWARE_PCRS))} "
        "(Azure's published measurements for the VM size) are"
    )
    return TdReleaseError(f"{source}: clouds.{cloud}: missing: {what} inputs, never computed")


def base_for(
    cloud: Cloud, firmware: TdFirmware, golden: TdBootGolden | TpmBootGolden, source: str
) -> dict[str, Any]:
    """The definition's `base` for `cloud`: its firmware inputs and the computed values."""
    if cloud is Cloud.gcp:
        gcp = firmware.clouds.gcp
        if gcp is None:
            raise _missing(cloud, source)
        if not isinstance(golden, TdBootGolden):
            raise TypeError("gcp's release is computed with golden_rtmrs")
        return {
            "mrtd": list(gcp.mrtd),
            "rtmr0": list(gcp.rtmr0),
            "rtmr1": [golden.rtmr1.hex()],
            "rtmr2": [golden.rtmr2.hex()],
        }
    azure = firmware.clouds.azure
    if azure is None:
        raise _missing(cloud, source)
    if not isinstance(golden, TpmBootGolden):
        raise TypeError("azure's release is computed with golden_pcrs")
    pcrs: dict[int, list[str]] = {i: list(v) for i, v in azure.pcrs.items()}
    pcrs.update({i: [v.hex()] for i, v in golden.pcrs.items()})
    return {"platform": "azure-tdx", "mrtd": list(azure.mrtd), "pcrs": dict(sorted(pcrs.items()))}


def tdx_definition(
    definition: ImageDefinition, cloud: Cloud, firmware: TdFirmware,
    golden: TdBootGolden | TpmBootGolden, source: str,
) -> ImageDefinition:  # fmt: skip
    """The definition as a `tee: tdx` release for `cloud`: every tdx rule of
    images.definition applies (no simulated quoting, no simulated forwarder)."""
    doc: dict[str, Any] = definition.model_dump(mode="json", exclude_none=True)
    doc["tee"] = "tdx"
    doc["base"] = base_for(cloud, firmware, golden, source)
    try:
        return parse_definition(doc, f"{definition.name} as tee: tdx for {cloud}")
    except DefinitionError as exc:
        raise TdReleaseError(str(exc)) from None


def golden_from_disks(
    disks: Mapping[str, object], source: str, cloud: Cloud = Cloud.gcp
) -> TdBootGolden | TpmBootGolden:
    """What the UKI and disk `umbra image disks --json` wrote (its `uki` and `raw` paths)
    determine for `cloud`: RTMR1/RTMR2 (gcp) or the SHA-256 PCRs (azure); refused unless that
    UKI is the one the document describes."""
    uki, raw = disks.get("uki"), disks.get("raw")
    if not isinstance(uki, str) or not isinstance(raw, str):
        raise TdReleaseError(f"{source}: uki and raw (the built files' paths) are required")
    compute = golden_rtmrs if cloud is Cloud.gcp else golden_pcrs
    try:
        golden = compute(Path(uki), Path(raw))
    except TdBootError as exc:
        raise TdReleaseError(str(exc)) from None
    app = next(m for m in golden.measured if m.event_type == EV_EFI_BOOT_SERVICES_APPLICATION)
    if app.sha384.hex() != disks.get("uki_authenticode_sha384"):
        raise TdReleaseError(
            f"{source}: uki_authenticode_sha384 is not the Authenticode hash of {uki} "
            f"({app.sha384.hex()}): the file changed after the disks were built"
        )
    return golden
