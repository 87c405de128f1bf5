"""Measurement policy files: the release manifest (from the image pipeline) plus the instance
binding (written at launch). Versioned, strict (unknown keys are errors), fail-closed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from umbra.attest.errors import PolicyFileError
from umbra.attest.tcb import TcbPolicy, TdPolicy
from umbra.contracts.model import Strict

API_VERSION = "umbra/v1"
SSH_KEYS_EVENT = "umbra.ssh-authorized-keys"
COMPOSE_HASH_EVENT = "compose-hash"


def _hex_of(n: int) -> Any:
    def check(v: str) -> str:
        v = v.lower().removeprefix("0x")
        try:
            raw = bytes.fromhex(v)
        except ValueError:
            raise ValueError("not a hex string") from None
        if n and len(raw) != n:
            raise ValueError(f"must be {n} bytes ({2 * n} hex digits), got {len(raw)}")
        return v

    return AfterValidator(check)


Hex48 = Annotated[str, _hex_of(48)]
Hex32 = Annotated[str, _hex_of(32)]
PcrIndex = Annotated[int, Field(ge=0, le=23)]
HexAny = Annotated[str, _hex_of(0)]


class ExpectedEvent(Strict):
    """A runtime event that must appear exactly once, on `imr`, with one of `payloads`.

    `payloads` None means present with any payload (e.g. an instance id).
    """

    name: str = Field(min_length=1)
    imr: int = 3
    payloads: list[HexAny] | None = Field(default=None, min_length=1)

    @field_validator("imr")
    @classmethod
    def _runtime_register(cls, v: int) -> int:
        # RTMR3 is the one runtime register (it accepts runtime events only); RTMR0-2 are
        # pinned whole by rtmr0-2, so a named event there could only restate the golden value.
        if v != 3:
            raise ValueError("named events are runtime events, extended into RTMR3 (imr: 3) only")
        return v


class ReleaseManifest(Strict):
    """Golden values of one image release: what the TD must have booted."""

    apiVersion: Literal["umbra/v1"]
    kind: Literal["ReleaseManifest"]
    name: str = Field(min_length=1)
    tee: Literal["tdx", "simulated"]  # whose root CA signs the quote
    # How the evidence is shaped: a bare TD quote, or Azure's paravisor chain (HCL report + vTPM
    # quote), whose boot measurements are PCRs because the guest's RTMRs stay zero.
    platform: Literal["tdx", "azure-tdx"] = "tdx"
    mrtd: list[Hex48] = Field(min_length=1)
    rtmr0: list[Hex48] | None = Field(default=None, min_length=1)
    rtmr1: list[Hex48] | None = Field(default=None, min_length=1)
    rtmr2: list[Hex48] | None = Field(default=None, min_length=1)
    pcrs: dict[PcrIndex, list[Hex32]] | None = Field(default=None, min_length=1)
    mr_seam: list[Hex48] | None = Field(default=None, min_length=1)
    events: list[ExpectedEvent] = Field(default_factory=list)
    other_runtime_events: Literal["refuse", "allow"] = "refuse"
    tcb: TcbPolicy = Field(default_factory=TcbPolicy)
    td: TdPolicy = Field(default_factory=TdPolicy)

    @model_validator(mode="after")
    def _unique_events(self) -> ReleaseManifest:
        _check_unique(self.events)
        rtmrs = (self.rtmr0, self.rtmr1, self.rtmr2)
        if self.platform == "tdx":
            if any(r is None for r in rtmrs):
                raise ValueError("platform tdx needs rtmr0, rtmr1 and rtmr2")
            if self.pcrs is not None:
                raise ValueError("pcrs are measured only on platform azure-tdx")
        else:
            if self.pcrs is None:
                raise ValueError("platform azure-tdx needs pcrs (its boot measurements)")
            if any(r is not None for r in rtmrs):
                raise ValueError("RTMRs are zero under the Azure paravisor: pin pcrs instead")
            if self.events:
                raise ValueError("runtime events are not measured on platform azure-tdx yet")
        return self


class InstanceBinding(Strict):
    """What one launch bound into the TD: written by the orchestrator when it starts the CVM."""

    apiVersion: Literal["umbra/v1"]
    kind: Literal["InstanceBinding"]
    release: str = Field(min_length=1)
    instance_id: str | None = None  # a label for people; bind it via `events` to enforce it
    ssh_authorized_keys: list[str] = Field(default_factory=list)
    events: list[ExpectedEvent] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_events(self) -> InstanceBinding:
        _check_unique(self.events)
        if any(e.name == SSH_KEYS_EVENT for e in self.events) and self.ssh_authorized_keys:
            raise ValueError(f"{SSH_KEYS_EVENT} is derived from ssh_authorized_keys; not both")
        for key in self.ssh_authorized_keys:
            canonical_ssh_key(key)
        return self


def _check_unique(events: list[ExpectedEvent]) -> None:
    names = [e.name for e in events]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"events listed twice: {', '.join(sorted(dup))}")


def canonical_ssh_key(line: str) -> str:
    """`type base64` only: comments and options do not change which key logs in."""
    parts = line.split()
    if len(parts) < 2 or not parts[0].startswith(("ssh-", "ecdsa-", "sk-")):
        raise ValueError(f"not an OpenSSH public key line: {line[:40]!r}")
    return f"{parts[0]} {parts[1]}"


def ssh_keys_digest(keys: list[str]) -> bytes:
    """SHA-256 over the sorted canonical key lines, '\\n'-joined: the payload of the
    `umbra.ssh-authorized-keys` runtime event extended into RTMR3 at launch."""
    lines = sorted({canonical_ssh_key(k) for k in keys})
    return hashlib.sha256("\n".join(lines).encode()).digest()


class MeasurementPolicy(Strict):
    """A release manifest plus (optionally) the binding of one instance."""

    release: ReleaseManifest
    binding: InstanceBinding | None = None

    @model_validator(mode="after")
    def _binding_matches(self) -> MeasurementPolicy:
        if self.binding is not None and self.binding.release != self.release.name:
            raise ValueError(
                f"instance binding is for release {self.binding.release!r}, "
                f"not {self.release.name!r}"
            )
        if self.binding is not None:
            names = {e.name for e in self.release.events}
            clash = names & {e.name for e in self.binding.events}
            if clash:
                raise ValueError(f"events in both release and binding: {', '.join(sorted(clash))}")
        return self

    @property
    def tee(self) -> Literal["tdx", "simulated"]:
        return self.release.tee

    def expected_events(self) -> list[ExpectedEvent]:
        out = list(self.release.events)
        if self.binding is not None:
            out.extend(self.binding.events)
            if self.binding.ssh_authorized_keys:
                digest = ssh_keys_digest(self.binding.ssh_authorized_keys)
                out.append(ExpectedEvent(name=SSH_KEYS_EVENT, payloads=[digest.hex()]))
        return out


def _read(path: Path) -> tuple[str, Any]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyFileError(f"{path}: cannot read: {exc}") from None
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError, RecursionError) as exc:
        raise PolicyFileError(
            f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}"
        ) from None
    if not isinstance(doc, dict):
        raise PolicyFileError(f"{path}: top level must be a mapping")
    if doc.get("apiVersion") != API_VERSION:
        raise PolicyFileError(
            f"{path}: apiVersion {doc.get('apiVersion')!r} is not supported (want {API_VERSION!r})"
        )
    return text, doc


def _line_of(text: str, loc: tuple[int | str, ...]) -> int | None:
    """Best-effort line number of a pydantic error location in a YAML/JSON document."""
    try:
        node: Any = yaml.compose(text)
    except yaml.YAMLError:
        return None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if k.value == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            nxt = node.value[part] if part < len(node.value) else None
        else:
            nxt = None
        if nxt is None:
            break
        node = nxt
    return int(node.start_mark.line) + 1 if node is not None else None


def _validate[M: BaseModel](model: type[M], path: Path, text: str, doc: Any) -> M:
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        msgs = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            where = ".".join(str(p) for p in loc) or "(top level)"
            line = _line_of(text, loc)
            at = f":{line}" if line else ""
            msgs.append(f"{path}{at}: {where}: {err['msg']}")
        raise PolicyFileError("\n".join(msgs)) from None


def load_release_manifest(path: str | Path) -> ReleaseManifest:
    p = Path(path)
    text, doc = _read(p)
    return _validate(ReleaseManifest, p, text, doc)


def load_instance_binding(path: str | Path) -> InstanceBinding:
    p = Path(path)
    text, doc = _read(p)
    return _validate(InstanceBinding, p, text, doc)


def load_measurement_policy(
    release_path: str | Path, binding_path: str | Path | None = None
) -> MeasurementPolicy:
    release = load_release_manifest(release_path)
    binding = load_instance_binding(binding_path) if binding_path is not None else None
    try:
        return MeasurementPolicy(release=release, binding=binding)
    except ValidationError as exc:
        raise PolicyFileError(
            f"{binding_path}: " + "; ".join(str(e["msg"]) for e in exc.errors())
        ) from None
