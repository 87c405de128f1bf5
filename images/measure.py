"""Golden values of a release: the compose hash and the RTMR3 runtime events, dstack-style.

app-compose.json is canonical JSON: {docker_compose_file, manifest_version, name, runner:
"docker-compose"} for a Security CVM, {dev_cvm_host, manifest_version, name, runner:
"umbra-dev-host"} for a Dev CVM (its host definition, sandbox/dev_definition.py); its SHA-256 is
the compose hash, extended into RTMR3 as the `compose-hash` runtime event. Then come
the launch-bound events, in this order: `umbra.cvm-id` (payload: the id, UTF-8) and, on a Dev
CVM, `umbra.ssh-authorized-keys` (payload: attest's ssh_keys_digest) and, when launch data
carries one, `umbra.host-firewall` (payload: SHA-256 of the nftables ruleset). Last, on a Dev
CVM, the per-boot events: `umbra.boot-id` (16 random bytes, hex) and `umbra.ssh-host-key` (the
host key generated at this boot, `type base64`). Their names and positions are predicted; their
values cannot be, so a verifier reads them from the replayed log (boot_events_of) and checks their
shape. Event digests are attest's `runtime_event_digest`: this module never hashes an event itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from umbra.attest.eventlog import Event, make_runtime_event, replay
from umbra.attest.measurement import (
    COMPOSE_HASH_EVENT,
    SSH_KEYS_EVENT,
    ExpectedEvent,
    InstanceBinding,
    ReleaseManifest,
    canonical_ssh_key,
    ssh_keys_digest,
)
from umbra.attest.simulator import simulated_boot_values
from umbra.contracts.session import BOOT_ID_EVENT, SSH_HOST_KEY_EVENT
from umbra.contracts.session import CONSOLE_LAUNCH_EVENT as CONSOLE_LAUNCH_EVENT
from umbra.contracts.session import CVM_ID_EVENT as CVM_ID_EVENT
from umbra.contracts.session import HOST_FIREWALL_EVENT as HOST_FIREWALL_EVENT
from umbra.images.definition import BaseMeasurements, DevCvmDefinition, ImageDefinition
from umbra.sandbox.dev_definition import RUNNER as DEV_HOST_RUNNER
from umbra.sandbox.dev_definition import render_dev_host
from umbra.sandbox.render import Rendered, canonical_json, render_security_cvm

# HOST_FIREWALL_EVENT's payload: SHA-256 of the nftables ruleset the launch agent loads.
RTMR3 = 3


def app_compose(name: str, compose: Rendered, role: str = "security-cvm") -> bytes:
    """The measured wrapper: the Security CVM's compose file, or the Dev CVM's host definition."""
    if role == "dev-cvm":
        doc = {"dev_cvm_host": compose.text, "runner": DEV_HOST_RUNNER}
    else:
        doc = {"docker_compose_file": compose.text, "runner": "docker-compose"}
    return canonical_json({**doc, "manifest_version": 2, "name": name}).encode()


def release_events(compose_hash: bytes) -> list[Event]:
    return [make_runtime_event(RTMR3, COMPOSE_HASH_EVENT, compose_hash)]


def instance_events(
    role: str,
    cvm_id: str,
    ssh_keys: Sequence[str] = (),
    host_firewall: str | None = None,
    console_launch: bytes | None = None,
) -> list[Event]:
    """The launch-bound events, in the order the launch agent extends them."""
    events = [make_runtime_event(RTMR3, CVM_ID_EVENT, cvm_id.encode())]
    if (role == "console") != (console_launch is not None):
        raise ValueError("a Console launch, and only one, is measured with umbra.console-launch")
    if role == "dev-cvm":
        if not ssh_keys:
            raise ValueError("a Dev CVM launch needs at least one SSH authorized key")
        events.append(make_runtime_event(RTMR3, SSH_KEYS_EVENT, ssh_keys_digest(list(ssh_keys))))
    elif ssh_keys:
        raise ValueError("only a Dev CVM takes SSH authorized keys")
    if host_firewall is not None:
        if role != "dev-cvm":
            raise ValueError("only a Dev CVM takes a host firewall ruleset")
        events.append(
            make_runtime_event(RTMR3, HOST_FIREWALL_EVENT, firewall_digest(host_firewall))
        )
    if console_launch is not None:
        events.append(make_runtime_event(RTMR3, CONSOLE_LAUNCH_EVENT, console_launch))
    return events


# A Dev CVM's per-boot events, in extend order, after every launch-bound one.
BOOT_EVENTS = (BOOT_ID_EVENT, SSH_HOST_KEY_EVENT)
_HEX = frozenset("0123456789abcdef")


def boot_events(role: str, boot_id: str, host_key: str) -> list[Event]:
    """The per-boot events: this boot's id (32 lowercase hex chars) and its SSH host key (the
    canonical `type base64` line: what `umbra ssh` reads back from the verified log)."""
    if role != "dev-cvm":
        raise ValueError("only a Dev CVM has per-boot events (boot id, SSH host key)")
    if len(boot_id) != 32 or not set(boot_id) <= _HEX:
        raise ValueError(f"{BOOT_ID_EVENT} must be 16 bytes as 32 lowercase hex characters")
    return [
        make_runtime_event(RTMR3, BOOT_ID_EVENT, boot_id.encode()),
        make_runtime_event(RTMR3, SSH_HOST_KEY_EVENT, canonical_ssh_key(host_key).encode()),
    ]


def boot_events_of(role: str, log: Sequence[Event]) -> tuple[str, str] | None:
    """The per-boot values (boot id, host key) a log's RTMR3 tail carries, or None for a
    Security CVM. Raises ValueError unless the tail is exactly the two events, in order, each
    well-formed (re-derived through boot_events, so shape checks live in one place)."""
    if role != "dev-cvm":
        return None
    tail = [e for e in log if e.imr == RTMR3 and e.name][-len(BOOT_EVENTS) :]
    if tuple(e.name for e in tail) != BOOT_EVENTS:
        raise ValueError(f"the log does not end with {', '.join(BOOT_EVENTS)}")
    try:
        values = (tail[0].payload.decode(), tail[1].payload.decode())
    except UnicodeDecodeError:
        raise ValueError("a per-boot event's payload is not text") from None
    want = boot_events(role, *values)
    if [(e.name, e.payload, e.digest) for e in want] != [
        (e.name, e.payload, e.digest) for e in tail
    ]:
        raise ValueError("a per-boot event is not in its canonical form")
    return values


def firewall_digest(ruleset: str) -> bytes:
    return hashlib.sha256(ruleset.encode()).digest()


def expected_rtmr3(events: Sequence[Event]) -> bytes:
    return replay(events)[RTMR3]


def base_values(base: BaseMeasurements) -> dict[str, Any]:
    if base.simulated_image is not None:
        return simulated_boot_values(base.simulated_image)
    if base.platform == "azure-tdx":
        return {"mrtd": list(base.mrtd or []), "pcrs": dict(base.pcrs or {})}
    return {
        "mrtd": list(base.mrtd or []),
        "rtmr0": list(base.rtmr0 or []),
        "rtmr1": list(base.rtmr1 or []),
        "rtmr2": list(base.rtmr2 or []),
    }


@dataclass(frozen=True)
class Measurement:
    definition: ImageDefinition
    compose: Rendered
    app_compose: bytes
    release: ReleaseManifest

    @property
    def compose_hash(self) -> bytes:
        return hashlib.sha256(self.app_compose).digest()

    @property
    def role(self) -> str:
        return self.definition.role

    def events(self) -> list[Event]:
        return release_events(self.compose_hash)

    def binding(
        self, cvm_id: str, ssh_keys: Sequence[str] = (), host_firewall: str | None = None
    ) -> InstanceBinding:
        """What the launcher hands the verifier for one instance; SSH keys become the event,
        the host firewall ruleset an event pinned to its digest."""
        instance_events(self.role, cvm_id, ssh_keys, host_firewall)  # same checks as the launch
        events = []
        if host_firewall is not None:
            digest = firewall_digest(host_firewall).hex()
            events.append(ExpectedEvent(name=HOST_FIREWALL_EVENT, imr=RTMR3, payloads=[digest]))
        return InstanceBinding(
            apiVersion="umbra/v1",
            kind="InstanceBinding",
            release=self.release.name,
            instance_id=cvm_id,
            ssh_authorized_keys=list(ssh_keys),
            events=events,
        )


def _release_events(definition: ImageDefinition, digest: str) -> list[dict[str, Any]]:
    # None on azure-tdx: its guest cannot extend RTMR3 under the paravisor, so no runtime event
    # is measured there (attestation.md); the compose hash is bound by the signed manifest only.
    if definition.base.platform == "azure-tdx":
        return []
    return [
        {"name": COMPOSE_HASH_EVENT, "imr": RTMR3, "payloads": [digest]},
        # Present exactly once; its value is the instance's, bound by the forwarder's identity
        # rather than pinned per release.
        {"name": CVM_ID_EVENT, "imr": RTMR3},
        # Dev CVMs: present exactly once, chosen at each boot inside the TD.
        *(
            [{"name": name, "imr": RTMR3} for name in BOOT_EVENTS]
            if definition.role == "dev-cvm"
            else []
        ),
    ]


def measure(definition: ImageDefinition) -> Measurement:
    if isinstance(definition, DevCvmDefinition):
        compose = render_dev_host(definition.host)
    else:
        compose = render_security_cvm(definition.compose)
    app = app_compose(definition.name, compose, definition.role)
    digest = hashlib.sha256(app).hexdigest()
    release = ReleaseManifest.model_validate(
        {
            "apiVersion": "umbra/v1",
            "kind": "ReleaseManifest",
            "name": definition.name,
            "tee": definition.tee,
            **base_values(definition.base),
            "platform": definition.base.platform,
            "events": _release_events(definition, digest),
            "other_runtime_events": "refuse",
        }
    )
    return Measurement(definition, compose, app, release)
