"""Image definitions: what one CVM release is made of (YAML, strict), before measurement.

A definition names the role (dev-cvm or security-cvm), the base OS golden values (MRTD,
RTMR0-2, from the OS image build; or a simulated image), and the measured document's inputs: a
Security CVM's `compose`, a Dev CVM's `host` (its host definition, sandbox/dev_definition.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from umbra.attest.errors import PolicyFileError
from umbra.attest.measurement import Hex32, Hex48, PcrIndex, load_release_manifest
from umbra.attest.quote_source import QuoteSourceKind
from umbra.contracts.model import Strict as _Strict
from umbra.contracts.validation import lines
from umbra.sandbox.models import DevCvmInputs, SecurityCvmInputs


class DefinitionError(Exception):
    """An image definition cannot be used; the message names the file and field."""


class BaseMeasurements(_Strict):
    """Golden values of the OS image (firmware, kernel, initrd): lists accept several builds.
    `platform` as in the release manifest: tdx pins MRTD and RTMR0-2; azure-tdx pins MRTD (the
    paravisor's) and SHA-256 PCRs (its vTPM's), the RTMRs being zero there."""

    platform: Literal["tdx", "azure-tdx"] = "tdx"
    mrtd: list[Hex48] | None = Field(default=None, min_length=1)
    rtmr0: list[Hex48] | None = Field(default=None, min_length=1)
    rtmr1: list[Hex48] | None = Field(default=None, min_length=1)
    rtmr2: list[Hex48] | None = Field(default=None, min_length=1)
    pcrs: dict[PcrIndex, list[Hex32]] | None = Field(default=None, min_length=1)
    # For tee: simulated, the simulator's stand-in boot chain of this image name.
    simulated_image: Annotated[str, Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> BaseMeasurements:
        rtmrs = [self.rtmr0, self.rtmr1, self.rtmr2]
        literal = [self.mrtd, *rtmrs, self.pcrs]
        if self.simulated_image is not None:
            if any(v is not None for v in literal):
                raise ValueError("give either simulated_image or literal measurements, not both")
            if self.platform != "tdx":
                raise ValueError("simulated_image is the simulator's TD boot: platform tdx only")
        elif self.platform == "tdx":
            if self.pcrs is not None:
                raise ValueError("pcrs are measured only on platform azure-tdx")
            if any(v is None for v in [self.mrtd, *rtmrs]):
                raise ValueError("mrtd, rtmr0, rtmr1 and rtmr2 are all required")
        else:
            if any(v is not None for v in rtmrs):
                raise ValueError("RTMRs are zero under the Azure paravisor: pin pcrs instead")
            if self.mrtd is None or self.pcrs is None:
                raise ValueError("platform azure-tdx needs mrtd and pcrs")
        return self


class DevCvmDefinition(_Strict):
    apiVersion: Literal["umbra/v1"]
    kind: Literal["ImageDefinition"]
    role: Literal["dev-cvm"]
    tee: Literal["tdx", "simulated"]
    base: BaseMeasurements
    host: DevCvmInputs

    @property
    def name(self) -> str:
        return self.host.release


class SecurityCvmDefinition(_Strict):
    apiVersion: Literal["umbra/v1"]
    kind: Literal["ImageDefinition"]
    role: Literal["security-cvm"]
    tee: Literal["tdx", "simulated"]
    base: BaseMeasurements
    compose: SecurityCvmInputs

    @property
    def name(self) -> str:
        return self.compose.release


ImageDefinition = DevCvmDefinition | SecurityCvmDefinition


def _check_tee(d: ImageDefinition) -> ImageDefinition:
    if isinstance(d, DevCvmDefinition) and d.tee == "tdx" and d.host.allow_simulated:
        raise DefinitionError(
            f"{d.name}: a tee: tdx release must not let its forwarder accept simulated quotes"
        )
    configfs = QuoteSourceKind.configfs
    if isinstance(d, DevCvmDefinition) and d.tee == "tdx" and d.host.quote_source is not configfs:
        raise DefinitionError(
            f"{d.name}: a tee: tdx release's forwarder quotes with configfs-tsm, not "
            f"'{d.host.quote_source}' (the emulated clouds' simulated TDX module)"
        )
    if isinstance(d, SecurityCvmDefinition) and d.compose.simulated is not None:
        if d.tee == "tdx":
            raise DefinitionError(
                f"{d.name}: a tee: tdx release must not let its proxy quote with the simulator"
            )
        if d.compose.simulated.image != d.base.simulated_image:
            raise DefinitionError(
                f"{d.name}: compose.simulated.image must be base.simulated_image "
                f"({d.base.simulated_image!r}): the quotes would measure another image"
            )
    if (d.tee == "simulated") != (d.base.simulated_image is not None):
        raise DefinitionError(
            f"{d.name}: tee {d.tee!r} needs "
            + ("base.simulated_image" if d.tee == "simulated" else "literal base measurements")
        )
    return d


def parse_definition(doc: Any, source: str = "<definition>") -> ImageDefinition:
    if not isinstance(doc, dict):
        raise DefinitionError(f"{source}: top level must be a mapping")
    role = doc.get("role")
    model: type[DevCvmDefinition] | type[SecurityCvmDefinition]
    if role == "dev-cvm":
        model = DevCvmDefinition
    elif role == "security-cvm":
        model = SecurityCvmDefinition
    else:
        raise DefinitionError(f"{source}: role must be dev-cvm or security-cvm, got {role!r}")
    try:
        return _check_tee(model.model_validate(doc))
    except ValidationError as exc:
        msgs = [f"{source}: {line}" for line in lines(exc, "(top level)")]
        raise DefinitionError("\n".join(msgs)) from None


def load_definition(path: str | Path) -> ImageDefinition:
    """Load a definition; a Dev CVM's `security_cvm_release` may name a release file (relative)."""
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise DefinitionError(f"{p}: cannot read: {exc}") from None
    host = doc.get("host") if isinstance(doc, dict) else None
    if isinstance(host, dict) and isinstance(host.get("security_cvm_release"), str):
        ref = p.parent / host["security_cvm_release"]
        try:
            release = load_release_manifest(ref)
        except PolicyFileError as exc:
            raise DefinitionError(f"{p}: host.security_cvm_release: {exc}") from None
        host["security_cvm_release"] = release.model_dump(mode="json", exclude_none=True)
    return parse_definition(doc, str(p))
