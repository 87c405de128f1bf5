"""Provider adapter the Console calls to launch, update and destroy one developer's Dev CVM through
the Pulumi Automation API: one stack per Dev CVM (`<team>-<developer>-<cvm>` in project
`umbra-dev-cvm`), an inline program that reads the team stack's network outputs through a
StackReference, and engine events turned into small `ProvisionEvent`s for a progress callback.

One module a concern, re-exported here (callers import `umbra.components.automation`):

    spec         TeamTarget, DevCvmSpec, DevCvmOutputs; ProvisionerError
    events       EventKind, ProvisionEvent, translate_event
    robust       RobustStack (plugins, crash recovery, refresh, policy pack); transient errors
    program      the inline program (build_dev_cvm, config_program) and its config keys
    provisioner  PulumiDevCvmProvisioner: the runs, with retries

The Automation API drives the `pulumi` CLI; `stack_factory` is the seam where that happens.
"""

from __future__ import annotations

from collections.abc import Sequence

from umbra.components.automation.events import (
    EventKind,
    OnProvisionEvent,
    ProvisionEvent,
    translate_event,
)
from umbra.components.automation.program import (
    DEV_CVM_KEY,
    RUNNING_KEY,
    build_dev_cvm,
    config_program,
)
from umbra.components.automation.provisioner import (
    POLICY_PACK,
    PROJECT,
    PulumiDevCvmProvisioner,
    StackFactory,
    StackLike,
)
from umbra.components.automation.robust import (
    PLUGINS,
    TRANSIENT,
    EngineStack,
    RobustStack,
    error_text,
    installed_plugins,
)
from umbra.components.automation.spec import (
    DevCvmOutputs,
    DevCvmSpec,
    ProvisionerError,
    TeamTarget,
)

__all__: Sequence[str] = (
    "DEV_CVM_KEY",
    "PLUGINS",
    "POLICY_PACK",
    "PROJECT",
    "RUNNING_KEY",
    "TRANSIENT",
    "DevCvmOutputs",
    "DevCvmSpec",
    "EngineStack",
    "EventKind",
    "OnProvisionEvent",
    "ProvisionEvent",
    "ProvisionerError",
    "PulumiDevCvmProvisioner",
    "RobustStack",
    "StackFactory",
    "StackLike",
    "TeamTarget",
    "build_dev_cvm",
    "config_program",
    "error_text",
    "installed_plugins",
    "translate_event",
)
