"""A CVM's release verifier narrowed to its own launch, for enrollment and re-enrollment.

A Dev CVM's launch agent extends launch-bound RTMR3 events the release cannot name with a payload
(`umbra.ssh-authorized-keys`, `umbra.host-firewall`: per instance), and a release refuses
runtime events it does not list. The provider that launched the CVM recorded what its launch
data predicts (`provider_state.expected_events`, components.launch_data.expected_events, name ->
payload hex); those the release does not name become this CVM's instance binding, each pinned to
its one payload. So a quote enrolls only with exactly the keys and ruleset the Console launched
it with. A CVM with nothing recorded (the local provider's, a record from before providers
recorded it) is checked against the release alone, as before.
"""

from __future__ import annotations

import dataclasses
import logging

from pydantic import ValidationError

from umbra.attest.measurement import ExpectedEvent, InstanceBinding, MeasurementPolicy
from umbra.attest.verify import Verifier
from umbra.console.models import Cvm
from umbra.console.session_info import EVENTS_KEY

log = logging.getLogger("umbra.console.enroll")


def instance_verifier(verifier: Verifier, cvm: Cvm) -> Verifier:
    recorded = cvm.provider_state.get(EVENTS_KEY)
    if not isinstance(recorded, dict) or verifier.policy.binding is not None:
        return verifier
    named = {e.name for e in verifier.policy.release.events}
    try:
        events = [
            ExpectedEvent(name=name, payloads=[payload])
            for name, payload in recorded.items()
            if name not in named
        ]
        if not events:
            return verifier
        binding = InstanceBinding(
            apiVersion="umbra/v1",
            kind="InstanceBinding",
            release=verifier.policy.release.name,
            instance_id=cvm.id,
            events=events,
        )
        policy = MeasurementPolicy(release=verifier.policy.release, binding=binding)
    except ValidationError:
        # Fail closed: the release alone refuses the launch-bound events it does not list.
        log.warning("CVM %s: provider_state.%s is invalid; not used", cvm.id, EVENTS_KEY)
        return verifier
    return dataclasses.replace(verifier, policy=policy)
