"""What a developer's SSH client needs to know about one Dev CVM (`contracts.session`).

The provider records the ingress address and the release manifest in `provider_state` when it
launches the CVM (`ssh_ingress`: {host, port}; `release_manifest`: an attest ReleaseManifest).
The client trusts none of it on its own word: every item is checked against the CVM's quote.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from umbra.attest.measurement import ReleaseManifest
from umbra.attest.session_info import SessionInfo
from umbra.console.enums import CvmState
from umbra.console.models import Cvm
from umbra.contracts.session import HOST_FIREWALL_EVENT, SessionState, SshIngress

log = logging.getLogger("umbra.console.session")
INGRESS_KEY = "ssh_ingress"
RELEASE_KEY = "release_manifest"
# What the provider recorded of the launch data's RTMR3 events (components.launch_data).
EVENTS_KEY = "expected_events"


def session_info(cvm: Cvm) -> SessionInfo:
    state = {CvmState.running: SessionState.running, CvmState.stopped: SessionState.stopped}.get(
        cvm.state, SessionState.other
    )
    ingress: SshIngress | None = None
    release: ReleaseManifest | None = None
    raw_ingress, raw_release = (
        cvm.provider_state.get(INGRESS_KEY),
        cvm.provider_state.get(RELEASE_KEY),
    )
    try:
        ingress = SshIngress.model_validate(raw_ingress) if raw_ingress is not None else None
    except ValidationError:
        log.warning("CVM %s: provider_state.%s is invalid; not served", cvm.id, INGRESS_KEY)
    try:
        release = ReleaseManifest.model_validate(raw_release) if raw_release is not None else None
    except ValidationError:
        log.warning("CVM %s: provider_state.%s is invalid; not served", cvm.id, RELEASE_KEY)
    events = cvm.provider_state.get(EVENTS_KEY)
    firewall = events.get(HOST_FIREWALL_EVENT) if isinstance(events, dict) else None
    try:
        return _info(cvm, state, ingress, release, firewall)
    except ValidationError:
        # Only the firewall digest is unchecked above: withheld, the client refuses the event.
        log.warning("CVM %s: provider_state.%s is invalid; not served", cvm.id, EVENTS_KEY)
        return _info(cvm, state, ingress, release, None)


def _info(
    cvm: Cvm,
    state: SessionState,
    ingress: SshIngress | None,
    release: ReleaseManifest | None,
    firewall: object,
) -> SessionInfo:
    return SessionInfo(
        cvm_id=cvm.id,
        name=cvm.name,
        state=state,
        ingress=ingress,
        release=release,
        ssh_authorized_keys=list(cvm.ssh_keys),
        host_firewall_sha256=firewall,
    )
