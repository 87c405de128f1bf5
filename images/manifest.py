"""The release measurement manifest: every golden value of one release, in canonical JSON.

`release` is exactly an attest ReleaseManifest (what verifiers load); the rest says where each
value came from, so a reviewer can recompute it from the rendered files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import Field

from umbra.attest.measurement import ReleaseManifest
from umbra.contracts.model import Strict as _Strict
from umbra.contracts.session import BOOT_ID_EVENT, SSH_HOST_KEY_EVENT
from umbra.images.definition import DevCvmDefinition
from umbra.images.measure import CVM_ID_EVENT, Measurement
from umbra.sandbox.render import canonical_json

Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class RuntimeEventSpec(_Strict):
    name: str
    imr: int = Field(ge=0, le=3)
    bound: Literal["release", "launch", "boot"]
    payload: str | None = None  # hex, for release-bound events
    digest: str | None = None  # runtime_event_digest(name, payload), hex
    describes: str


class ImageEntry(_Strict):
    """One container image the release's compose file pins, and the provenance that built it."""

    ref: str
    digest: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
    provenance_sha256: Sha256Hex | None = None  # the DSSE envelope file's SHA-256


class BootEntry(_Strict):
    """The OS disk's boot payload (`umbra image disks --json`): the UKI the firmware measures
    into RTMR1 (its Authenticode hash), for golden RTMR1 values. Not itself an RTMR value."""

    uki_sha256: Sha256Hex
    uki_authenticode_sha384: Annotated[str, Field(pattern=r"^[0-9a-f]{96}$")]
    uki_authenticode_sha256: Sha256Hex
    cmdline: str = Field(min_length=1)
    verity_root_hash: Sha256Hex  # the root file system's, in cmdline (so under RTMR1)
    raw_sha256: Sha256Hex  # disk.raw


class MeasurementManifest(_Strict):
    apiVersion: Literal["umbra/v1"]
    kind: Literal["MeasurementManifest"]
    role: Literal["dev-cvm", "security-cvm"]
    release: ReleaseManifest
    files: dict[str, Sha256Hex]
    compose_hash: Sha256Hex
    rtmr3_events: list[RuntimeEventSpec]
    images: dict[str, ImageEntry] | None = None
    boot: BootEntry | None = None

    def canonical(self) -> bytes:
        return canonical_json(self.model_dump(mode="json", exclude_none=True)).encode()


def image_entries(m: Measurement, provenance: Mapping[str, str]) -> dict[str, ImageEntry]:
    """The compose's images; `provenance` maps a digest to its envelope's SHA-256 (if known). A
    Dev CVM runs no container image: its sandbox image is pinned by its keys in the measured host
    definition, and shipped in the OS image."""
    if isinstance(m.definition, DevCvmDefinition):
        return {}
    refs: dict[str, str] = m.definition.compose.images.model_dump()
    out = {}
    for name, ref in sorted(refs.items()):
        digest = ref.rsplit("@", 1)[1]
        out[name] = ImageEntry(ref=ref, digest=digest, provenance_sha256=provenance.get(digest))
    return out


def boot_entry(disks_json: Mapping[str, object]) -> BootEntry:
    """From `umbra image disks --json`: its boot fields (the paths are the build's, dropped).
    Raises pydantic.ValidationError for a missing or malformed field."""
    return BootEntry.model_validate({k: disks_json.get(k) for k in BootEntry.model_fields})


def build_manifest(
    m: Measurement, provenance: Mapping[str, str] | None = None, boot: BootEntry | None = None
) -> MeasurementManifest:
    events = [
        RuntimeEventSpec(
            name=e.name,
            imr=e.imr,
            bound="release",
            payload=e.payload.hex(),
            digest=e.digest.hex(),
            describes="SHA-256 of app-compose.json",
        )
        for e in m.events()
    ]
    events.append(
        RuntimeEventSpec(name=CVM_ID_EVENT, imr=3, bound="launch", describes="the CVM id, UTF-8")
    )
    if m.role == "dev-cvm":
        events.append(
            RuntimeEventSpec(
                name="umbra.ssh-authorized-keys",
                imr=3,
                bound="launch",
                describes="SHA-256 of the sorted, de-duplicated 'type base64' key lines, \\n-joined",
            )
        )
        events += [
            RuntimeEventSpec(
                name=BOOT_ID_EVENT,
                imr=3,
                bound="boot",
                describes="16 random bytes, 32 lowercase hex characters, chosen at each boot",
            ),
            RuntimeEventSpec(
                name=SSH_HOST_KEY_EVENT,
                imr=3,
                bound="boot",
                describes="the SSH host key generated in the TD at boot, 'type base64'",
            ),
        ]
    if m.release.platform == "azure-tdx":
        events = []  # nothing extends RTMR3 under Azure's paravisor (the release pins none)
    return MeasurementManifest(
        apiVersion="umbra/v1",
        kind="MeasurementManifest",
        role=m.definition.role,
        release=m.release,
        files={
            m.compose.name: m.compose.sha256,
            "app-compose.json": hashlib.sha256(m.app_compose).hexdigest(),
        },
        compose_hash=m.compose_hash.hex(),
        rtmr3_events=events,
        images=image_entries(m, provenance) if provenance is not None else None,
        boot=boot,
    )
